/* kvemu._blockmap: the per-block maps of kvemu.index.PrefixIndex, open-addressing tables keyed by u64 hashes.
 *
 * HashMap: u64 -> u64 (a rank's external block hash -> the block's sequence hash);
 * SegMap:  u64 -> object, a strong reference (a block's sequence hash -> the segment holding it).
 * Both are the native form of kvemu.blockmap's dict subclasses (their pure-Python reference): the single-key
 * mapping protocol plus bulk operations over one event's list of hashes. No policy: kvemu.index decides, and
 * hands these tables exact u64 ints only (anything else moves it to the dicts). Keys are checked anyway: an int
 * outside [0, 2**64) or a non-int is never present (lookups miss, deletions raise KeyError) and cannot be stored
 * (OverflowError / TypeError, nothing changed). Iteration order is unspecified (the index never depends on it).
 * Grows without limit; tombstones are dropped when the table is rebuilt.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "u64.h"

#define CTRL_EMPTY 0
#define CTRL_FULL 1
#define CTRL_DEAD 2

typedef struct {
    uint64_t key;
    uint64_t val; /* a u64, or a PyObject * holding a strong reference (SegMap) */
} Entry;

typedef struct {
    uint8_t *ctrl;   /* cap control bytes */
    Entry *ent;      /* cap entries */
    size_t cap;      /* 0 or a power of two */
    int shift;       /* 64 - log2(cap) */
    Py_ssize_t live; /* full slots */
    Py_ssize_t dead; /* tombstones */
} Table;

typedef struct {
    PyObject_HEAD
    Table t;
    int objects; /* values are strong references */
} Map;

static inline size_t home(const Table *t, uint64_t k) {
    return (size_t)((k * 0x9E3779B97F4A7C15ULL) >> t->shift);
}

/* The slot of k, or -1. */
static inline Py_ssize_t find(const Table *t, uint64_t k) {
    if (t->live == 0)
        return -1;
    size_t mask = t->cap - 1, i = home(t, k);
    for (;;) {
        uint8_t c = t->ctrl[i];
        if (c == CTRL_EMPTY)
            return -1;
        if (c == CTRL_FULL && t->ent[i].key == k)
            return (Py_ssize_t)i;
        i = (i + 1) & mask;
    }
}

/* Room for ``more`` new keys at a load of at most 3/4 (live + tombstones); a rebuild drops the tombstones.
 * MemoryError, state unchanged, when the new arrays cannot be allocated. */
static int reserve(Table *t, Py_ssize_t more) {
    if (more < 0)
        more = 0;
    if ((size_t)(t->live + t->dead + more) * 4 <= t->cap * 3 && t->cap)
        return 0;
    if (more > PY_SSIZE_T_MAX / 16 - t->live) {
        PyErr_NoMemory();
        return -1;
    }
    size_t want = 2 * (size_t)(t->live + more), cap = 16;
    int bits = 4;
    while (cap < want) {
        cap *= 2;
        bits++;
    }
    if (cap == t->cap && t->dead == 0)
        return 0;
    uint8_t *ctrl = PyMem_Calloc(cap, 1);
    Entry *ent = PyMem_New(Entry, cap);
    if (ctrl == NULL || ent == NULL) {
        PyMem_Free(ctrl);
        PyMem_Free(ent);
        PyErr_NoMemory();
        return -1;
    }
    Table n = {ctrl, ent, cap, 64 - bits, t->live, 0};
    size_t mask = cap - 1;
    for (size_t j = 0; j < t->cap; j++) {
        if (t->ctrl[j] != CTRL_FULL)
            continue;
        size_t i = home(&n, t->ent[j].key);
        while (ctrl[i] != CTRL_EMPTY)
            i = (i + 1) & mask;
        ctrl[i] = CTRL_FULL;
        ent[i] = t->ent[j];
    }
    PyMem_Free(t->ctrl);
    PyMem_Free(t->ent);
    *t = n;
    return 0;
}

/* Put the absent key k -> v; the caller reserved room. */
static inline void insert(Table *t, uint64_t k, uint64_t v) {
    size_t mask = t->cap - 1, i = home(t, k);
    while (t->ctrl[i] == CTRL_FULL)
        i = (i + 1) & mask;
    if (t->ctrl[i] == CTRL_DEAD)
        t->dead--;
    t->ctrl[i] = CTRL_FULL;
    t->ent[i].key = k;
    t->ent[i].val = v;
    t->live++;
}

/* Empty the full slot i (a tombstone unless the probe chain ends right after it). */
static inline void erase(Table *t, size_t i) {
    if (t->ctrl[(i + 1) & (t->cap - 1)] == CTRL_EMPTY) {
        t->ctrl[i] = CTRL_EMPTY;
    } else {
        t->ctrl[i] = CTRL_DEAD;
        t->dead++;
    }
    t->live--;
}

/* ------------------------------------------------------------------ argument conversion */

/* A u64 to store, named ``what`` ("block hash": a key; "value": a HashMap value): TypeError unless an int,
 * OverflowError unless in [0, 2**64). */
static int store_u64(PyObject *obj, const char *what, uint64_t *out) {
    int rc = kvemu_u64_of(obj, out);
    if (rc > 0)
        return 0;
    if (rc == 0) {
        if (PyLong_Check(obj))
            PyErr_Format(PyExc_OverflowError, "%s %R must be in [0, 2**64) (an unsigned 64-bit hash)", what, obj);
        else
            PyErr_Format(PyExc_TypeError, "%s must be an int, got %.100s", what, Py_TYPE(obj)->tp_name);
    }
    return -1;
}

/* A list argument (TypeError otherwise): the bulk operations take one event's list of hashes. */
static int check_list(PyObject *obj, const char *what) {
    if (!PyList_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a list, got %.100s", what, Py_TYPE(obj)->tp_name);
        return -1;
    }
    return 0;
}

static int check_nargs(const char *name, Py_ssize_t nargs, Py_ssize_t lo, Py_ssize_t hi) {
    if (nargs < lo || nargs > hi) {
        if (lo == hi)
            PyErr_Format(PyExc_TypeError, "%s() takes %zd positional argument%s (%zd given)", name, lo,
                         lo == 1 ? "" : "s", nargs);
        else
            PyErr_Format(PyExc_TypeError, "%s() takes from %zd to %zd positional arguments (%zd given)", name, lo,
                         hi, nargs);
        return -1;
    }
    return 0;
}

/* Every item of a list as a store key, into a new PyMem buffer (*n items); NULL with TypeError /
 * OverflowError (naming the first bad item) otherwise. Runs no Python code. */
static uint64_t *key_buffer(PyObject *list, Py_ssize_t *n) {
    Py_ssize_t len = PyList_GET_SIZE(list);
    uint64_t *buf = PyMem_New(uint64_t, len > 0 ? len : 1);
    if (buf == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < len; i++) {
        if (store_u64(PyList_GET_ITEM(list, i), "block hash", &buf[i]) < 0) {
            PyMem_Free(buf);
            return NULL;
        }
    }
    *n = len;
    return buf;
}

static PyObject *value_obj(const Map *self, uint64_t v) {
    if (self->objects) {
        PyObject *o = (PyObject *)(uintptr_t)v;
        Py_INCREF(o);
        return o;
    }
    return PyLong_FromUnsignedLongLong(v);
}

/* ------------------------------------------------------------------ type slots */

static PyObject *map_new(PyTypeObject *type, PyObject *args, PyObject *kwargs, int objects) {
    if (PyTuple_GET_SIZE(args) || (kwargs != NULL && PyDict_GET_SIZE(kwargs))) {
        PyErr_Format(PyExc_TypeError, "%s() takes no arguments", type->tp_name);
        return NULL;
    }
    Map *self = (Map *)type->tp_alloc(type, 0);
    if (self == NULL)
        return NULL;
    self->objects = objects;
    return (PyObject *)self;
}

static PyObject *hashmap_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    return map_new(type, args, kwargs, 0);
}

static PyObject *segmap_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    return map_new(type, args, kwargs, 1);
}

/* Detach the table and drop its references (after the map is empty, so a finalizer sees a consistent map). */
static void map_release(Map *self) {
    Table t = self->t;
    self->t = (Table){NULL, NULL, 0, 64, 0, 0};
    if (self->objects) {
        for (size_t i = 0; i < t.cap; i++)
            if (t.ctrl[i] == CTRL_FULL)
                Py_DECREF((PyObject *)(uintptr_t)t.ent[i].val);
    }
    PyMem_Free(t.ctrl);
    PyMem_Free(t.ent);
}

static void hashmap_dealloc(Map *self) {
    map_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void segmap_dealloc(Map *self) {
    PyObject_GC_UnTrack(self);
    map_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int segmap_traverse(Map *self, visitproc visit, void *arg) {
    for (size_t i = 0; i < self->t.cap; i++)
        if (self->t.ctrl[i] == CTRL_FULL)
            Py_VISIT((PyObject *)(uintptr_t)self->t.ent[i].val);
    return 0;
}

static int segmap_clear(Map *self) {
    map_release(self);
    return 0;
}

static Py_ssize_t map_length(Map *self) {
    return self->t.live;
}

static int map_contains(Map *self, PyObject *key) {
    uint64_t k;
    int rc = kvemu_u64_of(key, &k);
    if (rc <= 0)
        return rc;
    return find(&self->t, k) >= 0;
}

static PyObject *map_subscript(Map *self, PyObject *key) {
    uint64_t k;
    int rc = kvemu_u64_of(key, &k);
    if (rc < 0)
        return NULL;
    Py_ssize_t i = rc ? find(&self->t, k) : -1;
    if (i < 0) {
        PyErr_SetObject(PyExc_KeyError, key);
        return NULL;
    }
    return value_obj(self, self->t.ent[i].val);
}

/* map[key] = value / del map[key]. */
static int map_ass_subscript(Map *self, PyObject *key, PyObject *value) {
    uint64_t k;
    if (value == NULL) {
        int rc = kvemu_u64_of(key, &k);
        if (rc < 0)
            return -1;
        Py_ssize_t i = rc ? find(&self->t, k) : -1;
        if (i < 0) {
            PyErr_SetObject(PyExc_KeyError, key);
            return -1;
        }
        uint64_t old = self->t.ent[i].val;
        erase(&self->t, (size_t)i);
        if (self->objects)
            Py_DECREF((PyObject *)(uintptr_t)old);
        return 0;
    }
    uint64_t v;
    if (store_u64(key, "block hash", &k) < 0)
        return -1;
    if (self->objects) {
        v = (uint64_t)(uintptr_t)value;
    } else if (store_u64(value, "value", &v) < 0) {
        return -1;
    }
    Py_ssize_t i = find(&self->t, k);
    if (i >= 0) {
        uint64_t old = self->t.ent[i].val;
        if (self->objects)
            Py_INCREF(value);
        self->t.ent[i].val = v;
        if (self->objects)
            Py_DECREF((PyObject *)(uintptr_t)old);
        return 0;
    }
    if (reserve(&self->t, 1) < 0)
        return -1;
    if (self->objects)
        Py_INCREF(value);
    insert(&self->t, k, v);
    return 0;
}

/* ------------------------------------------------------------------ methods */

PyDoc_STRVAR(get_doc, "get(key, default=None, /)\n--\n\nThe value of ``key``, or ``default``.");

static PyObject *map_get(Map *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("get", nargs, 1, 2) < 0)
        return NULL;
    uint64_t k;
    int rc = kvemu_u64_of(args[0], &k);
    if (rc < 0)
        return NULL;
    Py_ssize_t i = rc ? find(&self->t, k) : -1;
    if (i >= 0)
        return value_obj(self, self->t.ent[i].val);
    PyObject *d = nargs > 1 ? args[1] : Py_None;
    Py_INCREF(d);
    return d;
}

PyDoc_STRVAR(get_many_doc, "get_many(keys, /)\n--\n\n"
"HashMap: a list of each key's value, None where absent. SegMap: a list of each key's value; KeyError at the\n"
"first absent key.");

static PyObject *map_get_many(Map *self, PyObject *keys) {
    if (check_list(keys, "keys") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < n && j < PyList_GET_SIZE(keys); j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        uint64_t k;
        int rc = kvemu_u64_of(key, &k);
        if (rc < 0) {
            Py_DECREF(out);
            return NULL;
        }
        Py_ssize_t i = rc ? find(&self->t, k) : -1;
        PyObject *v;
        if (i >= 0) {
            v = value_obj(self, self->t.ent[i].val);
            if (v == NULL) {
                Py_DECREF(out);
                return NULL;
            }
        } else if (self->objects) {
            PyErr_SetObject(PyExc_KeyError, key);
            Py_DECREF(out);
            return NULL;
        } else {
            v = Py_None;
            Py_INCREF(v);
        }
        PyList_SET_ITEM(out, j, v);
    }
    return out;
}

PyDoc_STRVAR(delete_many_doc, "delete_many(keys, /)\n--\n\n"
"Delete every key in order; KeyError at the first absent one (the keys before it are deleted).");

/* Delete the keys of the list in order; ``strict``: KeyError at the first absent one (the keys before it are
 * deleted), else absent keys are skipped. A SegMap's references are released once the table is consistent. */
static PyObject *remove_keys(Map *self, PyObject *keys, int strict) {
    if (check_list(keys, "keys") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject **drop = NULL;
    Py_ssize_t ndrop = 0;
    if (self->objects && n) {
        drop = PyMem_New(PyObject *, n);
        if (drop == NULL) {
            PyErr_NoMemory();
            return NULL;
        }
    }
    PyObject *missing = NULL;
    int err = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        PyObject *key = PyList_GET_ITEM(keys, j);
        uint64_t k;
        int rc = kvemu_u64_of(key, &k);
        if (rc < 0) {
            err = 1;
            break;
        }
        Py_ssize_t i = rc ? find(&self->t, k) : -1;
        if (i < 0) {
            if (!strict)
                continue;
            missing = key;
            Py_INCREF(missing);
            break;
        }
        if (self->objects)
            drop[ndrop++] = (PyObject *)(uintptr_t)self->t.ent[i].val;
        erase(&self->t, (size_t)i);
    }
    for (Py_ssize_t j = 0; j < ndrop; j++)
        Py_DECREF(drop[j]);
    PyMem_Free(drop);
    if (missing != NULL) {
        PyErr_SetObject(PyExc_KeyError, missing);
        Py_DECREF(missing);
        return NULL;
    }
    if (err)
        return NULL;
    Py_RETURN_NONE;
}

static PyObject *map_delete_many(Map *self, PyObject *keys) {
    return remove_keys(self, keys, 1);
}

PyDoc_STRVAR(discard_many_doc, "discard_many(keys, /)\n--\n\nDelete every key present; absent keys are skipped.");

static PyObject *map_discard_many(Map *self, PyObject *keys) {
    return remove_keys(self, keys, 0);
}

PyDoc_STRVAR(isdisjoint_doc, "isdisjoint(keys, /)\n--\n\nWhether no key of the list is present.");

static PyObject *map_isdisjoint(Map *self, PyObject *keys) {
    if (check_list(keys, "keys") < 0)
        return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(keys); j++) {
        uint64_t k;
        int rc = kvemu_u64_of(PyList_GET_ITEM(keys, j), &k);
        if (rc < 0)
            return NULL;
        if (rc && find(&self->t, k) >= 0)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(update_pairs_doc, "update_pairs(keys, values, /)\n--\n\n"
"map[keys[i]] = values[i] for every i, in order (lists of equal length, ValueError otherwise). Every key and\n"
"value is checked before anything changes.");

static PyObject *hashmap_update_pairs(Map *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("update_pairs", nargs, 2, 2) < 0 || check_list(args[0], "keys") < 0 ||
        check_list(args[1], "values") < 0)
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(args[0]);
    if (PyList_GET_SIZE(args[1]) != n) {
        PyErr_Format(PyExc_ValueError, "update_pairs: %zd keys but %zd values", n, PyList_GET_SIZE(args[1]));
        return NULL;
    }
    uint64_t *buf = PyMem_New(uint64_t, n > 0 ? 2 * n : 1);
    if (buf == NULL) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (store_u64(PyList_GET_ITEM(args[0], j), "block hash", &buf[2 * j]) < 0 ||
            store_u64(PyList_GET_ITEM(args[1], j), "value", &buf[2 * j + 1]) < 0) {
            PyMem_Free(buf);
            return NULL;
        }
    }
    if (reserve(&self->t, n) < 0) {
        PyMem_Free(buf);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_ssize_t i = find(&self->t, buf[2 * j]);
        if (i >= 0)
            self->t.ent[i].val = buf[2 * j + 1];
        else
            insert(&self->t, buf[2 * j], buf[2 * j + 1]);
    }
    PyMem_Free(buf);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(set_many_doc, "set_many(keys, value, /)\n--\n\n"
"map[key] = value for every key of the list. Every key is checked before anything changes.");

static PyObject *segmap_set_many(Map *self, PyObject *const *args, Py_ssize_t nargs) {
    if (check_nargs("set_many", nargs, 2, 2) < 0 || check_list(args[0], "keys") < 0)
        return NULL;
    Py_ssize_t n;
    uint64_t *buf = key_buffer(args[0], &n);
    if (buf == NULL)
        return NULL;
    PyObject **drop = n ? PyMem_New(PyObject *, n) : NULL;
    if ((n && drop == NULL) || reserve(&self->t, n) < 0) {
        PyMem_Free(buf);
        PyMem_Free(drop);
        if (!PyErr_Occurred())
            PyErr_NoMemory();
        return NULL;
    }
    PyObject *value = args[1];
    uint64_t v = (uint64_t)(uintptr_t)value;
    Py_ssize_t ndrop = 0;
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_INCREF(value);
        Py_ssize_t i = find(&self->t, buf[j]);
        if (i >= 0) {
            drop[ndrop++] = (PyObject *)(uintptr_t)self->t.ent[i].val;
            self->t.ent[i].val = v;
        } else {
            insert(&self->t, buf[j], v);
        }
    }
    PyMem_Free(buf);
    for (Py_ssize_t j = 0; j < ndrop; j++)
        Py_DECREF(drop[j]);
    PyMem_Free(drop);
    Py_RETURN_NONE;
}

static PyObject *map_listing(Map *self, int what) { /* 0 keys, 1 values, 2 items */
    PyObject *out = PyList_New(self->t.live);
    if (out == NULL)
        return NULL;
    Py_ssize_t j = 0;
    for (size_t i = 0; i < self->t.cap && j < self->t.live; i++) {
        if (self->t.ctrl[i] != CTRL_FULL)
            continue;
        PyObject *k = NULL, *v = NULL, *item;
        if (what != 1 && (k = PyLong_FromUnsignedLongLong(self->t.ent[i].key)) == NULL)
            goto fail;
        if (what != 0 && (v = value_obj(self, self->t.ent[i].val)) == NULL) {
            Py_XDECREF(k);
            goto fail;
        }
        if (what == 2) {
            item = PyTuple_Pack(2, k, v);
            Py_DECREF(k);
            Py_DECREF(v);
            if (item == NULL)
                goto fail;
        } else {
            item = what == 0 ? k : v;
        }
        PyList_SET_ITEM(out, j++, item);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

PyDoc_STRVAR(keys_doc, "keys()\n--\n\nA list of the keys (order unspecified).");
PyDoc_STRVAR(values_doc, "values()\n--\n\nA list of the values (order unspecified).");
PyDoc_STRVAR(items_doc, "items()\n--\n\nA list of (key, value) pairs (order unspecified).");

static PyObject *map_keys(Map *self, PyObject *unused) {
    (void)unused;
    return map_listing(self, 0);
}

static PyObject *map_values(Map *self, PyObject *unused) {
    (void)unused;
    return map_listing(self, 1);
}

static PyObject *map_items(Map *self, PyObject *unused) {
    (void)unused;
    return map_listing(self, 2);
}

PyDoc_STRVAR(clear_doc, "clear()\n--\n\nRemove every entry.");

static PyObject *map_clear_method(Map *self, PyObject *unused) {
    (void)unused;
    map_release(self);
    Py_RETURN_NONE;
}

static PyMethodDef hashmap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, get_doc},
    {"get_many", (PyCFunction)map_get_many, METH_O, get_many_doc},
    {"delete_many", (PyCFunction)map_delete_many, METH_O, delete_many_doc},
    {"isdisjoint", (PyCFunction)map_isdisjoint, METH_O, isdisjoint_doc},
    {"update_pairs", (PyCFunction)(void (*)(void))hashmap_update_pairs, METH_FASTCALL, update_pairs_doc},
    {"keys", (PyCFunction)map_keys, METH_NOARGS, keys_doc},
    {"values", (PyCFunction)map_values, METH_NOARGS, values_doc},
    {"items", (PyCFunction)map_items, METH_NOARGS, items_doc},
    {"clear", (PyCFunction)map_clear_method, METH_NOARGS, clear_doc},
    {NULL, NULL, 0, NULL},
};

static PyMethodDef segmap_methods[] = {
    {"get", (PyCFunction)(void (*)(void))map_get, METH_FASTCALL, get_doc},
    {"get_many", (PyCFunction)map_get_many, METH_O, get_many_doc},
    {"delete_many", (PyCFunction)map_delete_many, METH_O, delete_many_doc},
    {"discard_many", (PyCFunction)map_discard_many, METH_O, discard_many_doc},
    {"set_many", (PyCFunction)(void (*)(void))segmap_set_many, METH_FASTCALL, set_many_doc},
    {"keys", (PyCFunction)map_keys, METH_NOARGS, keys_doc},
    {"values", (PyCFunction)map_values, METH_NOARGS, values_doc},
    {"items", (PyCFunction)map_items, METH_NOARGS, items_doc},
    {"clear", (PyCFunction)map_clear_method, METH_NOARGS, clear_doc},
    {NULL, NULL, 0, NULL},
};

static PyMappingMethods map_as_mapping = {
    .mp_length = (lenfunc)map_length,
    .mp_subscript = (binaryfunc)map_subscript,
    .mp_ass_subscript = (objobjargproc)map_ass_subscript,
};

static PySequenceMethods map_as_sequence = {
    .sq_contains = (objobjproc)map_contains,
};

static PyTypeObject HashMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvemu._blockmap.HashMap",
    .tp_basicsize = sizeof(Map),
    .tp_dealloc = (destructor)hashmap_dealloc,
    .tp_as_sequence = &map_as_sequence,
    .tp_as_mapping = &map_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("HashMap()\n--\n\nu64 -> u64 (external block hash -> sequence hash)."),
    .tp_methods = hashmap_methods,
    .tp_new = hashmap_new,
};

static PyTypeObject SegMapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "kvemu._blockmap.SegMap",
    .tp_basicsize = sizeof(Map),
    .tp_dealloc = (destructor)segmap_dealloc,
    .tp_as_sequence = &map_as_sequence,
    .tp_as_mapping = &map_as_mapping,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("SegMap()\n--\n\nu64 -> object, strong references (sequence hash -> segment)."),
    .tp_traverse = (traverseproc)segmap_traverse,
    .tp_clear = (inquiry)segmap_clear,
    .tp_methods = segmap_methods,
    .tp_new = segmap_new,
};

PyDoc_STRVAR(all_u64_doc, "all_u64(items, /)\n--\n\n"
"Whether every item of the list is an exact int in [0, 2**64) (what the native maps may be handed).");

static PyObject *all_u64(PyObject *module, PyObject *items) {
    (void)module;
    if (check_list(items, "items") < 0)
        return NULL;
    for (Py_ssize_t j = 0; j < PyList_GET_SIZE(items); j++) {
        PyObject *o = PyList_GET_ITEM(items, j);
        uint64_t k;
        if (!PyLong_CheckExact(o))
            Py_RETURN_FALSE;
        int rc = kvemu_u64_of(o, &k);
        if (rc < 0)
            return NULL;
        if (!rc)
            Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(distinct_u64_doc, "distinct_u64(items, extra, /)\n--\n\n"
"None when an item of the list, or extra (unless extra is None), is not an exact int in [0, 2**64); else whether "
"the items are pairwise distinct and extra is none of them (a store's chain and its parent).");

#define DISTINCT_SMALL 16 /* up to this many values: compared pairwise, no table */

/* Whether vals[0..n) are pairwise distinct: 1 yes, 0 no, -1 out of memory (set). Beyond a few values, through a
 * scratch table of the maps' own kind. */
static int all_distinct(const uint64_t *vals, Py_ssize_t n) {
    if (n <= DISTINCT_SMALL) {
        for (Py_ssize_t i = 1; i < n; i++)
            for (Py_ssize_t j = 0; j < i; j++)
                if (vals[i] == vals[j])
                    return 0;
        return 1;
    }
    Table seen = {NULL, NULL, 0, 64, 0, 0};
    if (reserve(&seen, n) < 0)
        return -1;
    int distinct = 1;
    for (Py_ssize_t i = 0; i < n && distinct; i++) {
        if (find(&seen, vals[i]) >= 0)
            distinct = 0;
        else
            insert(&seen, vals[i], 0);
    }
    PyMem_Free(seen.ctrl);
    PyMem_Free(seen.ent);
    return distinct;
}

static PyObject *distinct_u64(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (check_nargs("distinct_u64", nargs, 2, 2) < 0 || check_list(args[0], "items") < 0)
        return NULL;
    PyObject *items = args[0];
    /* Every value into a C buffer first (the extra one last): reading an int runs no Python code, so the list
     * cannot change under the loop, and the check then works on the copies alone. */
    Py_ssize_t n = PyList_GET_SIZE(items);
    Py_ssize_t total = n + (args[1] != Py_None);
    uint64_t small[DISTINCT_SMALL];
    uint64_t *vals = total <= DISTINCT_SMALL ? small : PyMem_New(uint64_t, total);
    if (vals == NULL)
        return PyErr_NoMemory();
    PyObject *result = NULL;
    int rc = 1;
    for (Py_ssize_t j = 0; j < total && rc > 0; j++) {
        PyObject *o = j < n ? PyList_GET_ITEM(items, j) : args[1];
        rc = PyLong_CheckExact(o) ? kvemu_u64_of(o, &vals[j]) : 0;
    }
    if (rc == 0) {
        result = Py_NewRef(Py_None);
    } else if (rc > 0) {
        int distinct = all_distinct(vals, total);
        if (distinct >= 0)
            result = PyBool_FromLong(distinct);
    }
    if (vals != small)
        PyMem_Free(vals);
    return result;
}

static PyMethodDef module_methods[] = {
    {"all_u64", (PyCFunction)all_u64, METH_O, all_u64_doc},
    {"distinct_u64", (PyCFunction)(void (*)(void))distinct_u64, METH_FASTCALL, distinct_u64_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvemu._blockmap",
    PyDoc_STR("Native per-block maps of kvemu.index.PrefixIndex (reference: kvemu.blockmap's dicts)."), -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockmap(void) {
    if (PyType_Ready(&HashMapType) < 0 || PyType_Ready(&SegMapType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "HashMap", (PyObject *)&HashMapType) < 0 ||
        PyModule_AddObjectRef(m, "SegMap", (PyObject *)&SegMapType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
