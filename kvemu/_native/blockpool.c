/* kvemu._blockpool: the block-level state of workers.blocks.BlockPool (eviction="lru") in C tables.
 *
 * One Table holds what the pure-Python pool keeps in ``cached`` and its LRU queue:
 *   - an open-addressing hash table (linear probing, backward-shift deletion, grows at half load, freed on
 *     dealloc) from a u64 sequence hash to an i64 value: a reference count (> 0, an active block) or minus the
 *     release tick (< 0, an inactive block); 0 marks an empty slot (no block ever has value 0);
 *   - the LRU queue of released blocks: entry i was released with tick ``qbase + i`` and is marked dead once that
 *     block is referenced again (the pure pool's None), consumed from ``head`` by eviction.
 * Every method is a loop over one request's run of blocks. No policy: the Python side (workers/blocks.py) decides
 * what to allocate, evict or log, and keeps ``free``, ``version`` and the log; this side only keeps the counters
 * it owns (``n_inactive``, ``tick``). Keys are read into a C buffer before the tables change, so no Python code
 * (a finalizer, a subclass method) runs while a pointer into a Python object is held.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "u64.h"
#include <string.h>

typedef struct {
    uint64_t key;
    int64_t val; /* 0: empty */
} Slot;

typedef struct {
    PyObject_HEAD
    Slot *slots;
    Py_ssize_t cap; /* a power of two (or 0 before the first insert) */
    Py_ssize_t count;
    uint64_t *q; /* LRU queue keys */
    unsigned char *qdead;
    Py_ssize_t qlen, qcap, head;
    int64_t qbase; /* tick of q[0] */
    int64_t tick;
    Py_ssize_t n_inactive;
    uint64_t *scratch; /* keys of the run being processed */
    Py_ssize_t *sidx; /* their slots (release) */
    Py_ssize_t scap;
} Table;

static inline uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static Py_ssize_t find(const Table *t, uint64_t key) {
    if (t->cap == 0)
        return -1;
    size_t mask = (size_t)t->cap - 1;
    size_t i = (size_t)mix(key) & mask;
    for (;;) {
        const Slot *s = &t->slots[i];
        if (s->val == 0)
            return -1;
        if (s->key == key)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

/* Room for ``extra`` more keys at most half load (growing the table); -1 with MemoryError set on failure. */
static int reserve(Table *t, Py_ssize_t extra) {
    if (extra < 0 || t->count > PY_SSIZE_T_MAX / 4 - extra) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t want = t->count + extra;
    if (want * 2 <= t->cap)
        return 0;
    Py_ssize_t cap = t->cap ? t->cap : 64;
    while (cap < want * 2)
        cap *= 2;
    Slot *slots = PyMem_Calloc((size_t)cap, sizeof(Slot));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    size_t mask = (size_t)cap - 1;
    for (Py_ssize_t j = 0; j < t->cap; j++) {
        Slot s = t->slots[j];
        if (s.val == 0)
            continue;
        size_t i = (size_t)mix(s.key) & mask;
        while (slots[i].val != 0)
            i = (i + 1) & mask;
        slots[i] = s;
    }
    PyMem_Free(t->slots);
    t->slots = slots;
    t->cap = cap;
    return 0;
}

/* Insert a key known to be absent (room reserved). */
static Py_ssize_t insert_new(Table *t, uint64_t key, int64_t val) {
    size_t mask = (size_t)t->cap - 1;
    size_t i = (size_t)mix(key) & mask;
    while (t->slots[i].val != 0)
        i = (i + 1) & mask;
    t->slots[i].key = key;
    t->slots[i].val = val;
    t->count++;
    return (Py_ssize_t)i;
}

static void delete_at(Table *t, Py_ssize_t at) {
    size_t mask = (size_t)t->cap - 1;
    size_t i = (size_t)at, j = (size_t)at;
    for (;;) {
        j = (j + 1) & mask;
        if (t->slots[j].val == 0)
            break;
        size_t k = (size_t)mix(t->slots[j].key) & mask;
        /* slot j may move to the hole at i unless its home k lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < k && k <= j) : (i < k || k <= j);
        if (!stays) {
            t->slots[i] = t->slots[j];
            i = j;
        }
    }
    t->slots[i].val = 0;
    t->count--;
}

static int scratch_reserve(Table *t, Py_ssize_t n) {
    if (n <= t->scap)
        return 0;
    Py_ssize_t cap = t->scap ? t->scap : 64;
    while (cap < n) {
        if (cap > PY_SSIZE_T_MAX / 2 / (Py_ssize_t)sizeof(uint64_t)) {
            PyErr_NoMemory();
            return -1;
        }
        cap *= 2;
    }
    uint64_t *s = PyMem_Realloc(t->scratch, (size_t)cap * sizeof(uint64_t));
    if (s == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->scratch = s;
    Py_ssize_t *x = PyMem_Realloc(t->sidx, (size_t)cap * sizeof(Py_ssize_t));
    if (x == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->sidx = x;
    t->scap = cap;
    return 0;
}

static int queue_reserve(Table *t, Py_ssize_t extra) {
    if (extra < 0 || t->qlen > PY_SSIZE_T_MAX / 4 / (Py_ssize_t)sizeof(uint64_t) - extra) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t want = t->qlen + extra;
    if (want <= t->qcap)
        return 0;
    Py_ssize_t cap = t->qcap ? t->qcap : 256;
    while (cap < want)
        cap *= 2;
    uint64_t *q = PyMem_Realloc(t->q, (size_t)cap * sizeof(uint64_t));
    if (q == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->q = q;
    unsigned char *d = PyMem_Realloc(t->qdead, (size_t)cap);
    if (d == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    t->qdead = d;
    t->qcap = cap;
    return 0;
}

static inline void queue_push(Table *t, uint64_t key) {
    t->q[t->qlen] = key;
    t->qdead[t->qlen] = 0;
    t->qlen++;
}

/* An inactive block (slot value -tick) is referenced again: it leaves the LRU queue. */
static void reactivate(Table *t, Py_ssize_t s) {
    int64_t idx = -t->slots[s].val - t->qbase;
    if (idx >= 0 && idx < t->qlen)
        t->qdead[idx] = 1;
    t->slots[s].val = 1;
    t->n_inactive--;
}

/* 1: ``obj`` is an int in [0, 2**64) (stored in *out); 0: any other object (no error); -1: error set. */
static int lookup_key(PyObject *obj, uint64_t *out) {
    return kvemu_u64_of(obj, out);
}

/* A key to insert: TypeError for a non-int, OverflowError outside [0, 2**64) (the reference's types). */
static int new_key(PyObject *obj, Py_ssize_t index, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "block hash [%zd] must be an int in [0, 2**64), got %.100s", index,
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = kvemu_u64_of(obj, out);
    if (rc > 0)
        return 0;
    if (rc == 0)
        PyErr_Format(PyExc_OverflowError, "block hash [%zd] must be in [0, 2**64)", index);
    return -1;
}

/* A count argument: an int (TypeError otherwise), in Py_ssize_t (OverflowError), >= 0 (ValueError, as islice). */
static int count_arg(PyObject *obj, const char *what, Py_ssize_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    Py_ssize_t v = PyLong_AsSsize_t(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0) {
        PyErr_Format(PyExc_ValueError, "%s must be >= 0, got %zd", what, v);
        return -1;
    }
    *out = v;
    return 0;
}

static int nargs_check(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional arguments (%zd given)", name, want, nargs);
        return -1;
    }
    return 0;
}

/* ------------------------------------------------------------------------------------------------ methods */

PyDoc_STRVAR(match_doc, "match(hashes, limit, /)\n--\n\n"
"(n, n_inactive): the cached prefix of hashes[:limit] and how many of its blocks are inactive.");

static PyObject *Table_match(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t limit;
    if (nargs_check("match", nargs, 2) < 0 || count_arg(args[1], "limit", &limit) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (limit < m)
        m = limit;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t n = 0, n_inactive = 0;
    for (; n < m; n++) {
        uint64_t key;
        int ok = lookup_key(items[n], &key);
        if (ok < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t s = ok ? find(t, key) : -1;
        if (s < 0)
            break;
        if (t->slots[s].val < 0)
            n_inactive++;
    }
    Py_DECREF(seq);
    return Py_BuildValue("(nn)", n, n_inactive);
}

PyDoc_STRVAR(take_doc, "take(hashes, n, /)\n--\n\n"
"Reference the first n blocks of hashes (all cached; KeyError at the first that is not, the earlier ones "
"taken), reactivating inactive ones.");

static PyObject *Table_take(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n;
    if (nargs_check("take", nargs, 2) < 0 || count_arg(args[1], "n", &n) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "hashes must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (n < m)
        m = n;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t key;
        int ok = lookup_key(items[i], &key);
        if (ok < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t s = ok ? find(t, key) : -1;
        if (s < 0) {
            PyErr_SetObject(PyExc_KeyError, items[i]);
            Py_DECREF(seq);
            return NULL;
        }
        if (t->slots[s].val > 0)
            t->slots[s].val++;
        else
            reactivate(t, s);
    }
    Py_DECREF(seq);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(release_doc, "release(held, n_full, /)\n--\n\n"
"Drop one reference of each block of held (a sequence's full blocks, tail first; KeyError before any change if "
"one is not cached). When their references sum to n_full (nobody else holds any), all go inactive with "
"consecutive ticks and the tick advances by n_full; otherwise block by block.");

static PyObject *Table_release(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n_full;
    if (nargs_check("release", nargs, 2) < 0 || count_arg(args[1], "n_full", &n_full) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "held must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (scratch_reserve(t, m) < 0 || queue_reserve(t, m) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int64_t sum = 0;
    int overflow = 0;
    for (Py_ssize_t i = 0; i < m; i++) {
        uint64_t key;
        int ok = lookup_key(items[i], &key);
        if (ok < 0) {
            Py_DECREF(seq);
            return NULL;
        }
        Py_ssize_t s = ok ? find(t, key) : -1;
        if (s < 0) {
            PyErr_SetObject(PyExc_KeyError, items[i]);
            Py_DECREF(seq);
            return NULL;
        }
        t->sidx[i] = s;
        if (__builtin_add_overflow(sum, t->slots[s].val, &sum))
            overflow = 1;
    }
    Py_DECREF(seq);
    /* (no insert or delete below: the slots found stay where they are) */
    if (!overflow && sum == (int64_t)n_full) {
        if (t->tick > INT64_MAX - (int64_t)n_full) {
            PyErr_SetString(PyExc_OverflowError, "release tick out of range");
            return NULL;
        }
        for (Py_ssize_t i = 0; i < m; i++) {
            t->slots[t->sidx[i]].val = -(t->tick + 1 + i);
            queue_push(t, t->slots[t->sidx[i]].key);
        }
        t->tick += n_full;
        t->n_inactive += n_full;
        Py_RETURN_NONE;
    }
    for (Py_ssize_t i = 0; i < m; i++) {
        Slot *s = &t->slots[t->sidx[i]];
        if (s->val > 1) {
            s->val--;
            continue;
        }
        if (t->tick == INT64_MAX) {
            PyErr_SetString(PyExc_OverflowError, "release tick out of range");
            return NULL;
        }
        t->tick++;
        s->val = -t->tick;
        t->n_inactive++;
        queue_push(t, s->key);
    }
    Py_RETURN_NONE;
}

PyDoc_STRVAR(evict_doc, "evict(n, /)\n--\n\n"
"Remove the n least recently released inactive blocks (the caller checked n <= n_inactive); returns their "
"hashes, oldest release first.");

static PyObject *Table_evict(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    Py_ssize_t n;
    if (nargs_check("evict", nargs, 1) < 0 || count_arg(args[0], "n", &n) < 0)
        return NULL;
    if (n > t->n_inactive) {
        PyErr_Format(PyExc_ValueError, "evict: %zd blocks requested, only %zd inactive", n, t->n_inactive);
        return NULL;
    }
    if (scratch_reserve(t, n) < 0)
        return NULL;
    Py_ssize_t head = t->head, got = 0;
    while (got < n) {
        if (head >= t->qlen) {
            PyErr_SetString(PyExc_RuntimeError, "evict: the LRU queue is out of step with the inactive blocks");
            return NULL;
        }
        if (!t->qdead[head]) {
            uint64_t key = t->q[head];
            Py_ssize_t s = find(t, key);
            if (s < 0 || t->slots[s].val != -(t->qbase + head)) {
                PyErr_SetString(PyExc_RuntimeError, "evict: the LRU queue is out of step with the inactive blocks");
                return NULL;
            }
            t->scratch[got++] = key;
        }
        head++;
    }
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLongLong(t->scratch[i]);
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    /* the list is built: nothing can fail from here, the tables change all at once */
    for (Py_ssize_t i = 0; i < n; i++)
        delete_at(t, find(t, t->scratch[i]));
    t->n_inactive -= n;
    if (head > 4096 && head * 2 > t->qlen) {
        memmove(t->q, t->q + head, (size_t)(t->qlen - head) * sizeof(uint64_t));
        memmove(t->qdead, t->qdead + head, (size_t)(t->qlen - head));
        t->qlen -= head;
        t->qbase += head;
        head = 0;
    }
    t->head = head;
    return out;
}

PyDoc_STRVAR(promote_doc, "promote(span, /)\n--\n\n"
"Blocks of span became full. None when none of them was cached: all stored with one reference. Otherwise, "
"block by block, a cached one gains a reference (reactivated if inactive) and a new one is stored; returns the "
"positions in span of the cached ones (TypeError / OverflowError before any change for a hash that is not a "
"u64).");

static PyObject *Table_promote(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs_check("promote", nargs, 1) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[0], "span must be a sequence");
    if (seq == NULL)
        return NULL;
    Py_ssize_t m = PySequence_Fast_GET_SIZE(seq);
    if (scratch_reserve(t, m) < 0) {
        Py_DECREF(seq);
        return NULL;
    }
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int disjoint = 1;
    for (Py_ssize_t i = 0; i < m; i++) {
        if (new_key(items[i], i, &t->scratch[i]) < 0) {
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    for (Py_ssize_t i = 0; i < m && disjoint; i++)
        disjoint = find(t, t->scratch[i]) < 0;
    if (reserve(t, m) < 0)
        return NULL;
    if (disjoint) {
        for (Py_ssize_t i = 0; i < m; i++) {
            Py_ssize_t s = find(t, t->scratch[i]);
            if (s < 0)
                insert_new(t, t->scratch[i], 1);
            else
                t->slots[s].val = 1; /* a hash twice in span: stored once */
        }
        Py_RETURN_NONE;
    }
    PyObject *hits = PyList_New(0);
    if (hits == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < m; i++) {
        Py_ssize_t s = find(t, t->scratch[i]);
        if (s < 0) {
            insert_new(t, t->scratch[i], 1);
            continue;
        }
        if (t->slots[s].val > 0)
            t->slots[s].val++;
        else
            reactivate(t, s);
        PyObject *pos = PyLong_FromSsize_t(i);
        if (pos == NULL || PyList_Append(hits, pos) < 0) {
            Py_XDECREF(pos);
            Py_DECREF(hits);
            return NULL;
        }
        Py_DECREF(pos);
    }
    return hits;
}

PyDoc_STRVAR(promote_one_doc, "promote_one(h, /)\n--\n\n"
"One block became full: True when it is new (stored with one reference), False when it was cached (it gains a "
"reference, reactivated if inactive).");

static PyObject *Table_promote_one(Table *t, PyObject *const *args, Py_ssize_t nargs) {
    uint64_t key;
    if (nargs_check("promote_one", nargs, 1) < 0 || new_key(args[0], 0, &key) < 0)
        return NULL;
    Py_ssize_t s = find(t, key);
    if (s >= 0) {
        if (t->slots[s].val > 0)
            t->slots[s].val++;
        else
            reactivate(t, s);
        Py_RETURN_FALSE;
    }
    if (reserve(t, 1) < 0)
        return NULL;
    insert_new(t, key, 1);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(get_doc, "get(h, /)\n--\n\nThe value of block h (refcount > 0, or -tick), None when not cached.");

static PyObject *Table_get(Table *t, PyObject *arg) {
    uint64_t key;
    int ok = lookup_key(arg, &key);
    if (ok < 0)
        return NULL;
    Py_ssize_t s = ok ? find(t, key) : -1;
    if (s < 0)
        Py_RETURN_NONE;
    return PyLong_FromLongLong(t->slots[s].val);
}

PyDoc_STRVAR(items_doc, "items()\n--\n\n[(hash, value)] of every cached block, in table order (no order promised).");

static PyObject *Table_items(Table *t, PyObject *Py_UNUSED(ignored)) {
    /* copied out first: boxing allocates, nothing else touches the table meanwhile */
    Py_ssize_t n = t->count, k = 0;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < t->cap && k < n; j++) {
        if (t->slots[j].val == 0)
            continue;
        PyObject *pair = Py_BuildValue("(NL)", PyLong_FromUnsignedLongLong(t->slots[j].key),
                                       (long long)t->slots[j].val);
        if (pair == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, k++, pair);
    }
    return out;
}

PyDoc_STRVAR(order_doc, "order()\n--\n\nThe inactive blocks in eviction order (oldest release first).");

static PyObject *Table_order(Table *t, PyObject *Py_UNUSED(ignored)) {
    PyObject *out = PyList_New(0);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = t->head; i < t->qlen; i++) {
        if (t->qdead[i])
            continue;
        PyObject *v = PyLong_FromUnsignedLongLong(t->q[i]);
        if (v == NULL || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

PyDoc_STRVAR(clear_doc, "clear()\n--\n\nDrop every block and the queue; ticks go on from where they were.");

static PyObject *Table_clear(Table *t, PyObject *Py_UNUSED(ignored)) {
    if (t->cap)
        memset(t->slots, 0, (size_t)t->cap * sizeof(Slot));
    t->count = 0;
    t->qlen = 0;
    t->head = 0;
    t->qbase = t->tick + 1;
    t->n_inactive = 0;
    Py_RETURN_NONE;
}

PyDoc_STRVAR(check_doc, "check()\n--\n\nAssert the tables' invariants (AssertionError naming the broken one).");

static PyObject *Table_check(Table *t, PyObject *Py_UNUSED(ignored)) {
    Py_ssize_t count = 0, inactive = 0;
    for (Py_ssize_t j = 0; j < t->cap; j++) {
        int64_t v = t->slots[j].val;
        if (v == 0)
            continue;
        count++;
        if (find(t, t->slots[j].key) != j) {
            PyErr_SetString(PyExc_AssertionError, "a block is not where its probe finds it");
            return NULL;
        }
        if (v < 0) {
            inactive++;
            int64_t idx = -v - t->qbase;
            if (idx < t->head || idx >= t->qlen || t->qdead[idx] || t->q[idx] != t->slots[j].key) {
                PyErr_SetString(PyExc_AssertionError, "LRU queue lost a block");
                return NULL;
            }
        }
    }
    if (count != t->count || inactive != t->n_inactive) {
        PyErr_SetString(PyExc_AssertionError, "block counts out of step with the table");
        return NULL;
    }
    Py_ssize_t live = 0;
    for (Py_ssize_t i = t->head; i < t->qlen; i++)
        live += !t->qdead[i];
    if (live != t->n_inactive) {
        PyErr_SetString(PyExc_AssertionError, "LRU queue out of step with the inactive blocks");
        return NULL;
    }
    Py_RETURN_NONE;
}

static Py_ssize_t Table_len(Table *t) { return t->count; }

static int Table_contains(Table *t, PyObject *arg) {
    uint64_t key;
    int ok = lookup_key(arg, &key);
    if (ok <= 0)
        return ok;
    return find(t, key) >= 0;
}

static PyObject *Table_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "Table() takes no arguments");
        return NULL;
    }
    Table *t = (Table *)type->tp_alloc(type, 0);
    if (t == NULL)
        return NULL;
    t->qbase = 1;
    return (PyObject *)t;
}

static void Table_dealloc(Table *t) {
    PyMem_Free(t->slots);
    PyMem_Free(t->q);
    PyMem_Free(t->qdead);
    PyMem_Free(t->scratch);
    PyMem_Free(t->sidx);
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyMethodDef Table_methods[] = {
    {"match", (PyCFunction)(void (*)(void))Table_match, METH_FASTCALL, match_doc},
    {"take", (PyCFunction)(void (*)(void))Table_take, METH_FASTCALL, take_doc},
    {"release", (PyCFunction)(void (*)(void))Table_release, METH_FASTCALL, release_doc},
    {"evict", (PyCFunction)(void (*)(void))Table_evict, METH_FASTCALL, evict_doc},
    {"promote", (PyCFunction)(void (*)(void))Table_promote, METH_FASTCALL, promote_doc},
    {"promote_one", (PyCFunction)(void (*)(void))Table_promote_one, METH_FASTCALL, promote_one_doc},
    {"get", (PyCFunction)Table_get, METH_O, get_doc},
    {"items", (PyCFunction)Table_items, METH_NOARGS, items_doc},
    {"order", (PyCFunction)Table_order, METH_NOARGS, order_doc},
    {"clear", (PyCFunction)Table_clear, METH_NOARGS, clear_doc},
    {"check", (PyCFunction)Table_check, METH_NOARGS, check_doc},
    {NULL, NULL, 0, NULL},
};

static PyObject *Table_get_n_inactive(Table *t, void *Py_UNUSED(closure)) { return PyLong_FromSsize_t(t->n_inactive); }
static PyObject *Table_get_tick(Table *t, void *Py_UNUSED(closure)) { return PyLong_FromLongLong(t->tick); }

static PyGetSetDef Table_getset[] = {
    {"n_inactive", (getter)Table_get_n_inactive, NULL, "Inactive (evictable) blocks.", NULL},
    {"tick", (getter)Table_get_tick, NULL, "The last release tick given.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods Table_as_sequence = {
    .sq_length = (lenfunc)Table_len,
    .sq_contains = (objobjproc)Table_contains,
};

static PyTypeObject TableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvemu._blockpool.Table",
    .tp_basicsize = sizeof(Table),
    .tp_dealloc = (destructor)Table_dealloc,
    .tp_as_sequence = &Table_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Table()\n--\n\nThe cached blocks of one BlockPool (hash -> refcount or -tick) and its "
                        "LRU queue."),
    .tp_methods = Table_methods,
    .tp_getset = Table_getset,
    .tp_new = Table_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvemu._blockpool",
    "Native block tables of workers.blocks.BlockPool (eviction='lru'); workers/blocks.py holds the pure-Python "
    "reference.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockpool(void) {
    if (PyType_Ready(&TableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&TableType);
    if (PyModule_AddObject(m, "Table", (PyObject *)&TableType) < 0) {
        Py_DECREF(&TableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
