/* kvemu._blockhash: the rolling block sequence hash, bit-exact with kvemu.hashing.extend_sequence_hashes_py.
 *
 * seq[i] = XXH3-64(le64(seq[i-1]) || le64(local[i]), seed 1337); seq[0] = local[0] when there is no parent.
 * Only XXH3-64's 9-16-byte path is needed (the input is always 16 bytes); it is written here from the public
 * XXH3 specification (xxHash's doc/xxhash_spec.md). No policy: one loop, every value checked to be a u64.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "u64.h"

#define SEQ_SEED 1337u
#define PRIME_MX1 0x165667919E3779F9ULL

/* Bytes 24..55 of XXH3's default secret, the four little-endian words the 9-16-byte path reads. */
static const unsigned char SECRET_24_56[32] = {
    0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78,
    0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e,
};

static uint64_t read_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

static uint64_t bswap64(uint64_t x) {
    uint64_t r = 0;
    for (int i = 0; i < 8; i++) {
        r = (r << 8) | (x & 0xff);
        x >>= 8;
    }
    return r;
}

/* 64x64 -> 128 multiply, folded: low half xor high half. */
static uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__SIZEOF_INT128__)
    __uint128_t p = (__uint128_t)a * b;
    return (uint64_t)p ^ (uint64_t)(p >> 64);
#else
    uint64_t a_lo = a & 0xffffffffu, a_hi = a >> 32, b_lo = b & 0xffffffffu, b_hi = b >> 32;
    uint64_t lo_lo = a_lo * b_lo, hi_lo = a_hi * b_lo, lo_hi = a_lo * b_hi, hi_hi = a_hi * b_hi;
    uint64_t cross = (lo_lo >> 32) + (hi_lo & 0xffffffffu) + lo_hi;
    uint64_t upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    uint64_t lower = (cross << 32) | (lo_lo & 0xffffffffu);
    return lower ^ upper;
#endif
}

/* The two seed-dependent bitflips of the 9-16-byte path, computed once at module init. */
static uint64_t flip_low, flip_high;

/* XXH3-64 of the 16 bytes le64(first) || le64(last), seed SEQ_SEED. */
static uint64_t xxh3_16(uint64_t first, uint64_t last) {
    uint64_t low = flip_low ^ first;
    uint64_t high = flip_high ^ last;
    uint64_t acc = 16u + bswap64(low) + high + mul128_fold64(low, high);
    acc ^= acc >> 37;
    acc *= PRIME_MX1;
    acc ^= acc >> 32;
    return acc;
}

/* The u64 in ``obj`` (an int in [0, 2**64)); TypeError / OverflowError naming ``what`` otherwise. */
static int as_u64(PyObject *obj, const char *what, Py_ssize_t index, uint64_t *out) {
    if (!PyLong_Check(obj)) {
        if (index < 0)
            PyErr_Format(PyExc_TypeError, "%s must be an int in [0, 2**64), got %.100s", what, Py_TYPE(obj)->tp_name);
        else
            PyErr_Format(PyExc_TypeError, "%s[%zd] must be an int in [0, 2**64), got %.100s", what, index,
                         Py_TYPE(obj)->tp_name);
        return -1;
    }
    int rc = kvemu_u64_of(obj, out);
    if (rc > 0)
        return 0;
    if (rc == 0) {
        if (index < 0)
            PyErr_Format(PyExc_OverflowError, "%s must be in [0, 2**64) (an unsigned 64-bit hash)", what);
        else
            PyErr_Format(PyExc_OverflowError, "%s[%zd] must be in [0, 2**64) (an unsigned 64-bit hash)", what, index);
    }
    return -1;
}

PyDoc_STRVAR(extend_doc,
"extend_sequence_hashes(parent, local_hashes, /)\n--\n\n"
"Sequence hashes of local_hashes continuing a chain whose last sequence hash is parent (None: a new chain).");

static PyObject *extend_sequence_hashes(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    (void)self;
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "extend_sequence_hashes() takes 2 positional arguments (%zd given)", nargs);
        return NULL;
    }
    uint64_t prev = 0;
    int have_prev = args[0] != Py_None;
    if (have_prev && as_u64(args[0], "parent", -1, &prev) < 0)
        return NULL;
    PyObject *seq = PySequence_Fast(args[1], "local_hashes must be a sequence of ints");
    if (seq == NULL)
        return NULL;
    /* Two passes: the chain is computed into a C buffer while nothing can run Python code (reading an int
     * neither allocates nor calls back), then boxed; so a finalizer run by an allocation cannot resize the
     * list under the item pointer. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    uint64_t *chain = PyMem_New(uint64_t, n > 0 ? n : 1);
    if (chain == NULL) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t h;
        if (as_u64(items[i], "local_hashes", i, &h) < 0) {
            PyMem_Free(chain);
            Py_DECREF(seq);
            return NULL;
        }
        prev = have_prev ? xxh3_16(prev, h) : h;
        have_prev = 1;
        chain[i] = prev;
    }
    Py_DECREF(seq);
    PyObject *out = PyList_New(n);
    for (Py_ssize_t i = 0; out != NULL && i < n; i++) {
        PyObject *value = PyLong_FromUnsignedLongLong(chain[i]);
        if (value == NULL)
            Py_CLEAR(out);  /* unset slots are NULL, which list dealloc skips */
        else
            PyList_SET_ITEM(out, i, value);
    }
    PyMem_Free(chain);
    return out;
}

static PyMethodDef methods[] = {
    {"extend_sequence_hashes", (PyCFunction)(void (*)(void))extend_sequence_hashes, METH_FASTCALL, extend_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvemu._blockhash",
    "Native rolling block sequence hash (XXH3-64, seed 1337); kvemu.hashing holds the pure-Python reference.",
    -1, methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__blockhash(void) {
    flip_low = (read_le64(SECRET_24_56) ^ read_le64(SECRET_24_56 + 8)) + SEQ_SEED;
    flip_high = (read_le64(SECRET_24_56 + 16) ^ read_le64(SECRET_24_56 + 24)) - SEQ_SEED;
    return PyModule_Create(&module);
}
