/* The one reading of a Python int as a u64 block hash that every native table of kvemu shares.
 *
 * kvemu_u64_of: 1 and *out set when ``obj`` is an int in [0, 2**64); 0 when it is any other object or an int out of
 * that range (no error set); -1 on an error other than those (set). Runs no Python code. On CPython 3.11 it reads
 * the int's 30-bit digits in place: PyLong_AsUnsignedLongLong goes through _PyLong_AsByteArray, which cost a third
 * of the prefix index's instructions. Elsewhere it takes the public calls. */
#ifndef KVEMU_NATIVE_U64_H
#define KVEMU_NATIVE_U64_H

#include <Python.h>
#include <stdint.h>

static inline int kvemu_u64_of(PyObject *obj, uint64_t *out) {
    if (!PyLong_Check(obj))
        return 0;
#if PY_VERSION_HEX < 0x030C0000 && PyLong_SHIFT == 30
    /* CPython 3.11's layout: |ob_size| digits of 30 bits, least significant first, the sign the int's; no leading
     * zero digit. */
    const digit *d = ((PyLongObject *)obj)->ob_digit;
    switch (Py_SIZE(obj)) {
    case 0:
        *out = 0;
        return 1;
    case 1:
        *out = d[0];
        return 1;
    case 2:
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30;
        return 1;
    case 3:
        if (d[2] >> 4)
            return 0;
        *out = (uint64_t)d[0] | (uint64_t)d[1] << 30 | (uint64_t)d[2] << 60;
        return 1;
    default:
        return 0; /* negative, or at least 2**90 */
    }
#else
    int sign = _PyLong_Sign(obj);
    if (sign <= 0) {
        *out = 0;
        return sign == 0;
    }
    size_t bits = _PyLong_NumBits(obj);
    if (bits == (size_t)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError))
            return -1;
        PyErr_Clear();
        return 0;
    }
    if (bits > 64)
        return 0;
    *out = (uint64_t)PyLong_AsUnsignedLongLongMask(obj);
    return 1;
#endif
}

#endif
