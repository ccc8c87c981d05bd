/* gateway.routing._ckeys: the canonical block keys of gateway/routing/keys.py in one pass.
 *
 * Exactly BlockKeyer's recurrence (docs/protocol.md, "Canonical block keys"): per prime p_m,
 * h_m = sum_k t_k * r[k][m] mod p_m, K_m = (K_m * B_m + h_m) mod p_m, key = K_0 << 32 | K_1.
 * The numpy path pays ~4 ns per token to copy a Python list into an array before it starts
 * and ~20 us of fixed cost per call; here each id is read once, straight from the list (or
 * from any 1-D integer buffer: numpy arrays, array('Q')), and hashed as it is read.
 *
 * Arithmetic: t < 2**31 and r < 2**27, so t * r < 2**58 and 32 terms plus a reduced partial
 * sum stay below 2**64; p < 2**32, so K * B + h < 2**64 for any K < 2**32 (a parent key's
 * halves are below 2**32 but may exceed p, which the recurrence allows).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define P0 4294967291ULL
#define P1 4294967279ULL
#define MAX_TOKEN_ID 2147483648LL /* 2**31 */
#define SUM_RUN 32               /* terms summed between reductions */

/* The keyed chain: r (2*bs interleaved words: r[k][0], r[k][1]), bases and start state. */
typedef struct {
    const uint64_t *r;
    Py_ssize_t bs;
    uint64_t b0, b1, k0, k1;
    PyObject *invalid; /* the exception class for bad ids (keys.InvalidTokens) */
} chain_t;

static void invalid(const chain_t *c, const char *msg) { PyErr_SetString(c->invalid, msg); }

/* Add id `t` (position `k` of its block) to the block's two sums, reduced every SUM_RUN terms
 * so they stay below 2**64 (each term is below 2**58). */
static inline void absorb(const chain_t *c, Py_ssize_t k, uint64_t t, uint64_t *h0, uint64_t *h1) {
    *h0 += t * c->r[2 * k];
    *h1 += t * c->r[2 * k + 1];
    if ((k + 1) % SUM_RUN == 0) {
        *h0 %= P0;
        *h1 %= P1;
    }
}

/* Fold one block's partial sums (h0, h1, already below 2**64) into the chain; return the key. */
static inline uint64_t step(chain_t *c, uint64_t h0, uint64_t h1) {
    c->k0 = (c->k0 * c->b0 + h0 % P0) % P0;
    c->k1 = (c->k1 * c->b1 + h1 % P1) % P1;
    return c->k0 << 32 | c->k1;
}

/* The value of an exact int that fits a machine word (every token id does), without a
 * call: 1, or 0 to take the general path. */
static inline int compact_value(PyObject *o, long long *t) {
#if PY_VERSION_HEX >= 0x030C0000
    if (PyUnstable_Long_IsCompact((PyLongObject *)o)) {
        *t = PyUnstable_Long_CompactValue((PyLongObject *)o);
        return 1;
    }
    return 0;
#else
    const digit *d = ((PyLongObject *)o)->ob_digit;
    switch (Py_SIZE(o)) {
    case 0: *t = 0; return 1;
    case 1: *t = d[0]; return 1;
    case 2: *t = (long long)d[0] | (long long)d[1] << PyLong_SHIFT; return 1;
    default: return 0;
    }
#endif
}

/* A token id from a Python object, or -1 with an exception set (InvalidTokens for a value
 * outside [0, 2**31) or a non-integer; other exceptions from __index__ propagate). */
static long long token_from_object(const chain_t *c, PyObject *o) {
    int overflow;
    long long v;
    if (PyLong_Check(o)) {
        v = PyLong_AsLongLongAndOverflow(o, &overflow);
    } else {
        PyObject *idx = PyNumber_Index(o);
        if (idx == NULL) {
            if (PyErr_ExceptionMatches(PyExc_TypeError) ||
                PyErr_ExceptionMatches(PyExc_ValueError) ||
                PyErr_ExceptionMatches(PyExc_OverflowError)) {
                PyErr_Clear();
                invalid(c, "token ids must be integers in [0, 2**31)");
            }
            return -1;
        }
        v = PyLong_AsLongLongAndOverflow(idx, &overflow);
        Py_DECREF(idx);
    }
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (overflow || v < 0 || v >= MAX_TOKEN_ID) {
        invalid(c, "token ids must be in [0, 2**31)");
        return -1;
    }
    return v;
}

/* Keys of n blocks of a list or tuple (`seq`, a PySequence_Fast result) from item `start`. */
static PyObject *keys_of_sequence(PyObject *seq, Py_ssize_t start, Py_ssize_t n, chain_t *c) {
    const Py_ssize_t bs = c->bs;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    Py_ssize_t i = start;
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t h0 = 0, h1 = 0;
        for (Py_ssize_t k = 0; k < bs; k++, i++) {
            /* __index__ (below) runs Python code that may shrink the list: check every read */
            if (i >= PySequence_Fast_GET_SIZE(seq)) {
                PyErr_SetString(PyExc_RuntimeError, "token list changed size while keyed");
                goto fail;
            }
            PyObject *o = PySequence_Fast_GET_ITEM(seq, i);
            long long t;
            if (PyLong_CheckExact(o) && compact_value(o, &t)) {
                if (t < 0 || t >= MAX_TOKEN_ID) {
                    invalid(c, "token ids must be in [0, 2**31)");
                    goto fail;
                }
            } else {
                Py_INCREF(o);
                t = token_from_object(c, o);
                Py_DECREF(o);
                if (t < 0)
                    goto fail;
            }
            absorb(c, k, (uint64_t)t, &h0, &h1);
        }
        PyObject *key = PyLong_FromUnsignedLongLong(step(c, h0, h1));
        if (key == NULL)
            goto fail;
        PyList_SET_ITEM(out, b, key);
    }
    return out;
fail:
    Py_DECREF(out);
    return NULL;
}

/* One id of a 1-D integer buffer (`fmt` one of bBhHiIlLqQnN, native order) as a signed value
 * (unsigned 64-bit values above 2**63 come back negative: invalid either way). */
static inline long long buffer_item(const char *p, char fmt) {
    switch (fmt) {
    case 'b': return *(const signed char *)p;
    case 'B': return *(const unsigned char *)p;
    case 'h': return *(const short *)p;
    case 'H': return *(const unsigned short *)p;
    case 'i': return *(const int *)p;
    case 'I': return *(const unsigned int *)p;
    case 'l': return *(const long *)p;
    case 'L': return (long long)*(const unsigned long *)p;
    case 'q': return *(const long long *)p;
    case 'Q': return (long long)*(const unsigned long long *)p;
    case 'n': return *(const Py_ssize_t *)p;
    default: return (long long)*(const size_t *)p; /* 'N' */
    }
}

/* Keys of n blocks of a 1-D integer buffer from item `start`. */
static PyObject *keys_of_buffer(const Py_buffer *view, char fmt, Py_ssize_t start, Py_ssize_t n,
                                chain_t *c) {
    const Py_ssize_t bs = c->bs;
    const Py_ssize_t stride = view->strides ? view->strides[0] : view->itemsize;
    const char *p = (const char *)view->buf + start * stride;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t b = 0; b < n; b++) {
        uint64_t h0 = 0, h1 = 0;
        for (Py_ssize_t k = 0; k < bs; k++, p += stride) {
            long long t = buffer_item(p, fmt);
            if (t < 0 || t >= MAX_TOKEN_ID) {
                invalid(c, "token ids must be in [0, 2**31)");
                Py_DECREF(out);
                return NULL;
            }
            absorb(c, k, (uint64_t)t, &h0, &h1);
        }
        PyObject *key = PyLong_FromUnsignedLongLong(step(c, h0, h1));
        if (key == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, b, key);
    }
    return out;
}

/* The integer format code of a buffer in native byte order, or 0 if it is not one. */
static char integer_format(const char *format) {
    if (format == NULL)
        return 'B';
    if (format[0] == '@')
        format++;
    if (format[0] != '\0' && format[1] == '\0' && strchr("bBhHiIlLqQnN", format[0]))
        return format[0];
    return 0;
}

static uint64_t as_u32(PyObject *o, int *err) {
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) {
        *err = 1;
        return 0;
    }
    if (v >> 32) {
        PyErr_SetString(PyExc_ValueError, "chain constants must be below 2**32");
        *err = 1;
    }
    return v;
}

PyDoc_STRVAR(keys_doc,
"keys(tokens, parent, params[, start, stop]) -> list[int] | NotImplemented\n\n"
"Keys of every full block of tokens[start:stop] (a list, a tuple, a 1-D integer buffer or any\n"
"sequence; no copy of the slice), chained from parent (None: from the start state). params = (r, block_size, b0, b1, s0, s1,\n"
"invalid): r holds 2*block_size native uint64 words r[k][0], r[k][1], each below 2**27;\n"
"invalid is the exception class for ids outside [0, 2**31). NotImplemented for a buffer that\n"
"is not 1-D integers (the caller keys it another way).");

static PyObject *ckeys_keys(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if ((nargs != 3 && nargs != 5) || !PyTuple_CheckExact(args[2]) ||
        PyTuple_GET_SIZE(args[2]) != 7) {
        PyErr_SetString(PyExc_TypeError, "keys(tokens, parent, params: 7-tuple[, start, stop])");
        return NULL;
    }
    Py_ssize_t start = 0, stop = PY_SSIZE_T_MAX;
    if (nargs == 5) {
        start = PyLong_AsSsize_t(args[3]);
        if (start == -1 && PyErr_Occurred())
            return NULL;
        stop = PyLong_AsSsize_t(args[4]);
        if (stop == -1 && PyErr_Occurred())
            return NULL;
        if (start < 0 || stop < start) {
            PyErr_SetString(PyExc_ValueError, "need 0 <= start <= stop");
            return NULL;
        }
    }
    (void)module;
    PyObject *tokens = args[0], *parent = args[1], *params = args[2];
    chain_t c;
    Py_buffer rview;
    if (PyObject_GetBuffer(PyTuple_GET_ITEM(params, 0), &rview, PyBUF_SIMPLE) < 0)
        return NULL;
    c.r = (const uint64_t *)rview.buf;
    c.invalid = PyTuple_GET_ITEM(params, 6);
    c.bs = PyLong_AsSsize_t(PyTuple_GET_ITEM(params, 1));
    int err = 0;
    if (c.bs == -1 && PyErr_Occurred())
        err = 1;
    else if (c.bs < 1 || rview.len != (Py_ssize_t)(16 * c.bs)) {
        PyErr_SetString(PyExc_ValueError, "r must hold 2 * block_size uint64 words");
        err = 1;
    }
    if (!err) c.b0 = as_u32(PyTuple_GET_ITEM(params, 2), &err);
    if (!err) c.b1 = as_u32(PyTuple_GET_ITEM(params, 3), &err);
    if (!err && parent == Py_None) {
        c.k0 = as_u32(PyTuple_GET_ITEM(params, 4), &err);
        if (!err) c.k1 = as_u32(PyTuple_GET_ITEM(params, 5), &err);
    } else if (!err) {
        unsigned long long v = 0;
        if (!PyLong_Check(parent)) { /* as the numpy path: a TypeError */
            PyErr_SetString(PyExc_TypeError, "parent key must be an int");
            err = 1;
        } else {
            v = PyLong_AsUnsignedLongLong(parent);
            if (v == (unsigned long long)-1 && PyErr_Occurred()) {
                err = 1;
                if (PyErr_ExceptionMatches(PyExc_OverflowError)) {
                    PyErr_Clear();
                    PyErr_SetString(PyExc_ValueError,
                                    "parent key must be a 64-bit unsigned integer");
                }
            }
        }
        c.k0 = v >> 32;
        c.k1 = v & 0xFFFFFFFFULL;
    }
    if (err) {
        PyBuffer_Release(&rview);
        return NULL;
    }

    PyObject *out = NULL;
    if (PyList_Check(tokens) || PyTuple_Check(tokens)) {
        Py_INCREF(tokens);
        Py_ssize_t end = Py_MIN(stop, PySequence_Fast_GET_SIZE(tokens));
        out = keys_of_sequence(tokens, start, end > start ? (end - start) / c.bs : 0, &c);
        Py_DECREF(tokens);
    } else if (PyObject_CheckBuffer(tokens)) {
        Py_buffer view;
        if (PyObject_GetBuffer(tokens, &view, PyBUF_STRIDES | PyBUF_FORMAT) < 0) {
            PyErr_Clear();
            out = Py_NewRef(Py_NotImplemented);
        } else {
            char fmt = integer_format(view.format);
            if (view.ndim != 1 || fmt == 0)
                out = Py_NewRef(Py_NotImplemented);
            else {
                Py_ssize_t end = Py_MIN(stop, view.shape[0]);
                out = keys_of_buffer(&view, fmt, start,
                                     end > start ? (end - start) / c.bs : 0, &c);
            }
            PyBuffer_Release(&view);
        }
    } else {
        /* any other sequence: its keyed part as a list (tokens past it are never read) */
        Py_ssize_t len = PySequence_Size(tokens);
        if (len >= 0) {
            Py_ssize_t end = Py_MIN(stop, len);
            Py_ssize_t n = end > start ? (end - start) / c.bs : 0;
            PyObject *part = PySequence_GetSlice(tokens, start, start + n * c.bs);
            PyObject *seq = part ? PySequence_Fast(part, "tokens must be a sequence") : NULL;
            Py_XDECREF(part);
            if (seq != NULL) {
                if (PySequence_Fast_GET_SIZE(seq) < n * c.bs)
                    PyErr_SetString(PyExc_ValueError, "token sequence shorter than its length");
                else
                    out = keys_of_sequence(seq, 0, n, &c);
                Py_DECREF(seq);
            }
        }
    }
    PyBuffer_Release(&rview);
    return out;
}

static PyMethodDef ckeys_methods[] = {
    {"keys", (PyCFunction)(void (*)(void))ckeys_keys, METH_FASTCALL, keys_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ckeys_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "gateway.routing._ckeys",
    .m_doc = "Canonical block keys (gateway/routing/keys.py) computed in C.",
    .m_size = 0,
    .m_methods = ckeys_methods,
};

PyMODINIT_FUNC PyInit__ckeys(void) { return PyModule_Create(&ckeys_module); }
