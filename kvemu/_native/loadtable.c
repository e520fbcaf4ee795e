/* kvemu._loadtable: the block-level state of kvemu.load.LoadTracker, a table of plain u64s.
 *
 * HolderTable keeps two insertion-ordered open-addressing tables (entries in insertion order plus an index of
 * slots, as CPython's dict does, so iteration order equals the pure tracker's dicts):
 *   holders: block sequence hash -> bitmask of the rank indexes (0..63) holding it (never 0 while present);
 *   extras:  (block, rank index) -> references beyond the first that rank holds (never 0 while present).
 * Bulk operations per request: book / release a whole block list for one rank, one active-prefix walk for all
 * ranks, a binary search for one. No policy: kvemu.load decides, and migrates to its pure-Python dicts before a
 * 65th rank bit would be needed. Every hash is checked to be a u64 (TypeError / OverflowError, as the reference's
 * array("Q") check raises) before any state changes. Holds no Python objects (no GC); grows without limit.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "u64.h"

#define EMPTY ((Py_ssize_t)-1)
#define DUMMY ((Py_ssize_t)-2)
#define MAX_RANKS 64

typedef struct {
    uint64_t *key;    /* entries, in insertion order */
    uint32_t *sub;    /* second key part: the rank index (extras), 0 (holders) */
    uint64_t *val;    /* 0: a deleted entry */
    Py_ssize_t *slot; /* icap slots: EMPTY, DUMMY or an entry index */
    Py_ssize_t ecap;  /* entry capacity; icap = 2 * ecap, both powers of two */
    Py_ssize_t used;  /* entries appended (live and deleted) */
    Py_ssize_t live;
} Table;

static uint64_t mix(uint64_t k, uint32_t s) {
    uint64_t x = k ^ ((uint64_t)s * 0x9E3779B97F4A7C15ULL);
    x ^= x >> 30;
    x *= 0xBF58476D1CE4E5B9ULL;
    x ^= x >> 27;
    x *= 0x94D049BB133111EBULL;
    x ^= x >> 31;
    return x;
}

static void table_free(Table *t) {
    PyMem_Free(t->key);
    PyMem_Free(t->sub);
    PyMem_Free(t->val);
    PyMem_Free(t->slot);
    t->key = NULL;
    t->sub = NULL;
    t->val = NULL;
    t->slot = NULL;
    t->ecap = t->used = t->live = 0;
}

/* The slot position of (k, s), or of the EMPTY slot where the probe ended (*found = 0). */
static Py_ssize_t probe(const Table *t, uint64_t k, uint32_t s, int *found) {
    size_t mask = (size_t)(2 * t->ecap) - 1;
    size_t i = (size_t)mix(k, s) & mask;
    for (;;) {
        Py_ssize_t e = t->slot[i];
        if (e == EMPTY) {
            *found = 0;
            return (Py_ssize_t)i;
        }
        if (e >= 0 && t->key[e] == k && t->sub[e] == s) {
            *found = 1;
            return (Py_ssize_t)i;
        }
        i = (i + 1) & mask;
    }
}

/* The entry index of (k, s), or -1. */
static Py_ssize_t find(const Table *t, uint64_t k, uint32_t s) {
    if (t->live == 0)
        return -1;
    int found;
    Py_ssize_t i = probe(t, k, s, &found);
    return found ? t->slot[i] : -1;
}

/* Room for ``more`` appended entries: otherwise the live entries are compacted (in order) into a table of at
 * least twice their number plus ``more``. MemoryError (state unchanged) when that cannot be allocated. */
static int table_reserve(Table *t, Py_ssize_t more) {
    if (t->used + more <= t->ecap)
        return 0;
    if (more > PY_SSIZE_T_MAX / 8 - t->live) {
        PyErr_NoMemory();
        return -1;
    }
    Py_ssize_t want = 2 * (t->live + more), ecap = 8;
    while (ecap < want)
        ecap *= 2;
    uint64_t *key = PyMem_New(uint64_t, ecap);
    uint32_t *sub = PyMem_New(uint32_t, ecap);
    uint64_t *val = PyMem_New(uint64_t, ecap);
    Py_ssize_t *slot = PyMem_New(Py_ssize_t, 2 * ecap);
    if (key == NULL || sub == NULL || val == NULL || slot == NULL) {
        PyMem_Free(key);
        PyMem_Free(sub);
        PyMem_Free(val);
        PyMem_Free(slot);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < 2 * ecap; i++)
        slot[i] = EMPTY;
    size_t mask = (size_t)(2 * ecap) - 1;
    Py_ssize_t n = 0;
    for (Py_ssize_t e = 0; e < t->used; e++) {
        if (!t->val[e])
            continue;
        key[n] = t->key[e];
        sub[n] = t->sub[e];
        val[n] = t->val[e];
        size_t i = (size_t)mix(key[n], sub[n]) & mask;
        while (slot[i] != EMPTY)
            i = (i + 1) & mask;
        slot[i] = n++;
    }
    table_free(t);
    t->key = key;
    t->sub = sub;
    t->val = val;
    t->slot = slot;
    t->ecap = ecap;
    t->used = t->live = n;
    return 0;
}

/* Append (k, s) -> v; the caller checked it is absent and reserved room. */
static void table_insert(Table *t, uint64_t k, uint32_t s, uint64_t v) {
    size_t mask = (size_t)(2 * t->ecap) - 1;
    size_t i = (size_t)mix(k, s) & mask;
    while (t->slot[i] >= 0)
        i = (i + 1) & mask;
    Py_ssize_t e = t->used++;
    t->key[e] = k;
    t->sub[e] = s;
    t->val[e] = v;
    t->slot[i] = e;
    t->live++;
}

/* Delete the present entry (k, s). */
static void table_delete(Table *t, uint64_t k, uint32_t s) {
    int found;
    Py_ssize_t i = probe(t, k, s, &found);
    if (!found)
        return;
    t->val[t->slot[i]] = 0;
    t->slot[i] = DUMMY;
    t->live--;
}

typedef struct {
    PyObject_HEAD
    Table holders;
    Table extras;
} HolderTable;

/* The u64 value of ``obj``: an int, or an object with __index__ (as array("Q") accepts); TypeError /
 * OverflowError otherwise. May run Python code (__index__) only for a non-int. */
static int as_u64(PyObject *obj, Py_ssize_t index, uint64_t *out) {
    PyObject *num;
    if (PyLong_Check(obj)) {
        num = obj;
        Py_INCREF(num);
    } else {
        num = PyNumber_Index(obj);
        if (num == NULL)
            return -1;
    }
    int rc = kvemu_u64_of(num, out);
    Py_DECREF(num);
    if (rc > 0)
        return 0;
    if (rc == 0)
        PyErr_Format(PyExc_OverflowError, "block hash [%zd] must be in [0, 2**64) (an unsigned 64-bit hash)", index);
    return -1;
}

/* Every value of the iterable ``obj`` as a u64, into a new PyMem buffer (*n values); NULL with an exception
 * set otherwise. The list is re-read at each step (an __index__ may change it): no pointer into it is kept. */
static uint64_t *u64_buffer(PyObject *obj, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, "block hashes must be an iterable of ints");
    if (seq == NULL)
        return NULL;
    Py_ssize_t cap = PySequence_Fast_GET_SIZE(seq);
    uint64_t *buf = PyMem_New(uint64_t, cap > 0 ? cap : 1);
    if (buf == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    Py_ssize_t i = 0;
    for (; i < PySequence_Fast_GET_SIZE(seq) && i < cap; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, i);
        Py_INCREF(item);
        int rc = as_u64(item, i, &buf[i]);
        Py_DECREF(item);
        if (rc < 0) {
            PyMem_Free(buf);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    *n = i;
    return buf;
}

/* A rank index argument: an int in [0, 64). */
static int rank_index(PyObject *obj, uint32_t *out) {
    if (!PyLong_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "rank index must be an int, got %.100s", Py_TYPE(obj)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(obj);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v >= MAX_RANKS) {
        PyErr_Format(PyExc_ValueError, "rank index must be in [0, %d), got %ld", MAX_RANKS, v);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t want) {
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s() takes %zd positional argument%s (%zd given)", name, want,
                     want == 1 ? "" : "s", nargs);
        return -1;
    }
    return 0;
}

static PyObject *ht_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "HolderTable() takes no arguments");
        return NULL;
    }
    HolderTable *self = (HolderTable *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    if (table_reserve(&self->holders, 8) < 0 || table_reserve(&self->extras, 8) < 0) {
        Py_DECREF(self);
        return NULL;
    }
    return (PyObject *)self;
}

static void ht_dealloc(HolderTable *self) {
    table_free(&self->holders);
    table_free(&self->extras);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(book_doc, "book(blocks, index, /)\n--\n\n"
"Book the blocks (a list of u64 sequence hashes) on rank ``index``: a block the rank holds already gains a\n"
"reference. Returns how many blocks became active on the rank. Nothing changes when a hash is invalid.");

static PyObject *ht_book(HolderTable *self, PyObject *const *args, Py_ssize_t nargs) {
    uint32_t r;
    if (check_nargs("book", nargs, 2) < 0 || rank_index(args[1], &r) < 0)
        return NULL;
    Py_ssize_t n;
    uint64_t *blocks = u64_buffer(args[0], &n);
    if (blocks == NULL)
        return NULL;
    if (table_reserve(&self->holders, n) < 0 || table_reserve(&self->extras, n) < 0) {
        PyMem_Free(blocks);
        return NULL;
    }
    Table *h = &self->holders, *x = &self->extras;
    uint64_t bit = (uint64_t)1 << r;
    Py_ssize_t fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = blocks[i];
        Py_ssize_t e = find(h, k, 0);
        if (e < 0) {
            table_insert(h, k, 0, bit);
            fresh++;
        } else if (!(h->val[e] & bit)) {
            h->val[e] |= bit;
            fresh++;
        } else {
            Py_ssize_t c = find(x, k, r);
            if (c < 0)
                table_insert(x, k, r, 1);
            else
                x->val[c]++;
        }
    }
    PyMem_Free(blocks);
    return PyLong_FromSsize_t(fresh);
}

PyDoc_STRVAR(release_doc, "release(blocks, index, /)\n--\n\n"
"Release the blocks a booking on rank ``index`` holds. Returns how many blocks stopped being active on the\n"
"rank. KeyError for a block the rank does not hold (a booking never booked).");

static PyObject *ht_release(HolderTable *self, PyObject *const *args, Py_ssize_t nargs) {
    uint32_t r;
    if (check_nargs("release", nargs, 2) < 0 || rank_index(args[1], &r) < 0)
        return NULL;
    Py_ssize_t n;
    uint64_t *blocks = u64_buffer(args[0], &n);
    if (blocks == NULL)
        return NULL;
    Table *h = &self->holders, *x = &self->extras;
    uint64_t bit = (uint64_t)1 << r;
    Py_ssize_t gone = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t k = blocks[i];
        Py_ssize_t c = find(x, k, r);
        if (c >= 0) {
            if (x->val[c] > 1)
                x->val[c]--;
            else
                table_delete(x, k, r);
            continue;
        }
        Py_ssize_t e = find(h, k, 0);
        if (e < 0 || !(h->val[e] & bit)) {
            PyMem_Free(blocks);
            PyObject *key = PyLong_FromUnsignedLongLong(k);
            if (key != NULL) {
                PyErr_SetObject(PyExc_KeyError, key);
                Py_DECREF(key);
            }
            return NULL;
        }
        h->val[e] ^= bit;
        if (!h->val[e])
            table_delete(h, k, 0);
        gone++;
    }
    PyMem_Free(blocks);
    return PyLong_FromSsize_t(gone);
}

PyDoc_STRVAR(check_doc, "check(hashes, /)\n--\n\nTypeError / OverflowError unless every hash is a u64.");

static PyObject *ht_check(HolderTable *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (check_nargs("check", nargs, 1) < 0)
        return NULL;
    Py_ssize_t n;
    uint64_t *buf = u64_buffer(args[0], &n);
    if (buf == NULL)
        return NULL;
    PyMem_Free(buf);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(active_prefixes_doc, "active_prefixes(hashes, keys, /)\n--\n\n"
"For every rank holding the first block, {keys[index]: how many leading blocks of hashes it holds}, in the\n"
"order the pure tracker gives (shorter prefixes first, then lower rank index).");

static PyObject *ht_active_prefixes(HolderTable *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("active_prefixes", nargs, 2) < 0)
        return NULL;
    if (!PyList_Check(args[1])) {
        PyErr_Format(PyExc_TypeError, "keys must be a list, got %.100s", Py_TYPE(args[1])->tp_name);
        return NULL;
    }
    Py_ssize_t n;
    uint64_t *seq = u64_buffer(args[0], &n);
    if (seq == NULL)
        return NULL;
    uint32_t idx[MAX_RANKS];
    Py_ssize_t len[MAX_RANKS];
    int found = 0;
    Table *h = &self->holders;
    if (n && h->live) {
        Py_ssize_t e = find(h, seq[0], 0);
        uint64_t active = e < 0 ? 0 : h->val[e];
        for (Py_ssize_t i = 1; active && i <= n; i++) {
            uint64_t mask = 0;
            if (i < n) {
                e = find(h, seq[i], 0);
                mask = e < 0 ? 0 : h->val[e] & active;
            }
            if (mask != active) {
                uint64_t gone = active & ~mask;
                while (gone) {
                    uint64_t low = gone & (~gone + 1);
                    uint32_t r = 0;
                    while (!((low >> r) & 1))
                        r++;
                    idx[found] = r;
                    len[found++] = i;
                    gone ^= low;
                }
                active = mask;
            }
        }
    }
    PyMem_Free(seq);
    PyObject *out = PyDict_New();
    for (int j = 0; out != NULL && j < found; j++) {
        PyObject *keys = args[1];
        if ((Py_ssize_t)idx[j] >= PyList_GET_SIZE(keys) || PyList_GET_ITEM(keys, idx[j]) == Py_None) {
            PyErr_Format(PyExc_KeyError, "no key for rank index %u", (unsigned)idx[j]);
            Py_CLEAR(out);
            break;
        }
        PyObject *key = PyList_GET_ITEM(keys, idx[j]);
        Py_INCREF(key);
        PyObject *value = PyLong_FromSsize_t(len[j]);
        int rc = value == NULL ? -1 : PyDict_SetItem(out, key, value);
        Py_DECREF(key);
        Py_XDECREF(value);
        if (rc < 0)
            Py_CLEAR(out);
    }
    return out;
}

static int held(const Table *h, uint64_t k, uint64_t bit) {
    Py_ssize_t e = find(h, k, 0);
    return e >= 0 && (h->val[e] & bit);
}

PyDoc_STRVAR(prefix_len_doc, "prefix_len(hashes, index, /)\n--\n\n"
"How many leading blocks of hashes rank ``index`` holds (a binary search: its set is prefix-closed).");

static PyObject *ht_prefix_len(HolderTable *self, PyObject *const *args, Py_ssize_t nargs) {
    uint32_t r;
    if (check_nargs("prefix_len", nargs, 2) < 0 || rank_index(args[1], &r) < 0)
        return NULL;
    Py_ssize_t n;
    uint64_t *seq = u64_buffer(args[0], &n);
    if (seq == NULL)
        return NULL;
    const Table *h = &self->holders;
    uint64_t bit = (uint64_t)1 << r;
#define HELD(i) (held(h, seq[(i)], bit))
    Py_ssize_t lo = 0, hi = n;
    if (!hi || !HELD(0)) {
        lo = 0;
    } else if (HELD(hi - 1)) {
        lo = hi;
    } else {
        lo = 1;
        hi -= 1;
        while (lo < hi) {
            Py_ssize_t mid = lo + ((hi - lo) >> 1);
            if (HELD(mid))
                lo = mid + 1;
            else
                hi = mid;
        }
    }
#undef HELD
    PyMem_Free(seq);
    return PyLong_FromSsize_t(lo);
}

/* {block: value} in insertion order: every holders entry with its mask (r < 0); the blocks rank r holds with
 * their reference counts (refs); the extras entries of rank r with their counts (not refs). The pairs are copied
 * out first, so boxing (which may run a finalizer) reads no table. */
static PyObject *collect(HolderTable *self, int r, int refs) {
    Table *t = (r >= 0 && !refs) ? &self->extras : &self->holders;
    Py_ssize_t m = 0;
    uint64_t *pairs = PyMem_New(uint64_t, 2 * (t->live > 0 ? t->live : 1));
    if (pairs == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t e = 0; e < t->used; e++) {
        uint64_t v = t->val[e];
        if (!v)
            continue;
        if (r >= 0 && refs) {
            if (!((v >> r) & 1))
                continue;
            Py_ssize_t c = find(&self->extras, t->key[e], (uint32_t)r);
            v = 1 + (c < 0 ? 0 : self->extras.val[c]);
        } else if (r >= 0 && t->sub[e] != (uint32_t)r) {
            continue;
        }
        pairs[2 * m] = t->key[e];
        pairs[2 * m + 1] = v;
        m++;
    }
    PyObject *out = PyDict_New();
    for (Py_ssize_t j = 0; out != NULL && j < m; j++) {
        PyObject *key = PyLong_FromUnsignedLongLong(pairs[2 * j]);
        PyObject *value = key == NULL ? NULL : PyLong_FromUnsignedLongLong(pairs[2 * j + 1]);
        int rc = value == NULL ? -1 : PyDict_SetItem(out, key, value);
        Py_XDECREF(key);
        Py_XDECREF(value);
        if (rc < 0)
            Py_CLEAR(out);
    }
    PyMem_Free(pairs);
    return out;
}

static PyObject *rank_collect(HolderTable *self, PyObject *arg, int refs) {
    uint32_t r;
    if (rank_index(arg, &r) < 0)
        return NULL;
    return collect(self, (int)r, refs);
}

PyDoc_STRVAR(block_refs_doc, "block_refs(index, /)\n--\n\n"
"Every block rank ``index`` holds with its reference count, in the order the blocks became active.");

static PyObject *ht_block_refs(HolderTable *self, PyObject *arg) { return rank_collect(self, arg, 1); }

PyDoc_STRVAR(extra_refs_doc, "extra_refs(index, /)\n--\n\n"
"The blocks rank ``index`` holds more than once, with the references beyond the first (the pure tracker's\n"
"RankLoad.extra_refs, as a dict in the same order).");

static PyObject *ht_extra_refs(HolderTable *self, PyObject *arg) { return rank_collect(self, arg, 0); }

PyDoc_STRVAR(masks_doc, "masks()\n--\n\nEvery active block with the bitmask of the rank indexes holding it, in "
"insertion order.");

static PyObject *ht_masks(HolderTable *self, PyObject *unused) {
    (void)unused;
    return collect(self, -1, 0);
}

static Py_ssize_t ht_len(HolderTable *self) { return self->holders.live; }

static PyMethodDef ht_methods[] = {
    {"book", (PyCFunction)(void (*)(void))ht_book, METH_FASTCALL, book_doc},
    {"release", (PyCFunction)(void (*)(void))ht_release, METH_FASTCALL, release_doc},
    {"check", (PyCFunction)(void (*)(void))ht_check, METH_FASTCALL, check_doc},
    {"active_prefixes", (PyCFunction)(void (*)(void))ht_active_prefixes, METH_FASTCALL, active_prefixes_doc},
    {"prefix_len", (PyCFunction)(void (*)(void))ht_prefix_len, METH_FASTCALL, prefix_len_doc},
    {"block_refs", (PyCFunction)ht_block_refs, METH_O, block_refs_doc},
    {"extra_refs", (PyCFunction)ht_extra_refs, METH_O, extra_refs_doc},
    {"masks", (PyCFunction)ht_masks, METH_NOARGS, masks_doc},
    {NULL, NULL, 0, NULL},
};

static PySequenceMethods ht_as_sequence = {.sq_length = (lenfunc)ht_len};

static PyTypeObject HolderTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvemu._loadtable.HolderTable",
    .tp_basicsize = sizeof(HolderTable),
    .tp_dealloc = (destructor)ht_dealloc,
    .tp_as_sequence = &ht_as_sequence,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("HolderTable()\n--\n\nActive blocks -> holder rank masks (u64) and per-rank extra "
                        "references: kvemu.load.LoadTracker's block state."),
    .tp_methods = ht_methods,
    .tp_new = ht_new,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvemu._loadtable",
    "Native block table of kvemu.load.LoadTracker (ranks 0..63); kvemu.load holds the pure-Python reference.",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__loadtable(void) {
    if (PyType_Ready(&HolderTableType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    Py_INCREF(&HolderTableType);
    if (PyModule_AddObject(m, "HolderTable", (PyObject *)&HolderTableType) < 0) {
        Py_DECREF(&HolderTableType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
