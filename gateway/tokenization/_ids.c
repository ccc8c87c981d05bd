/* gateway.tokenization._ids: tuples of token ids that the cyclic collector does not walk.
 *
 * The tokenizer keeps every chat's ids up to its last cut as a tuple of shared int objects
 * (gateway/tokenization/cache.py): one ~8,000-item tuple per turn of a long chat. A tuple
 * of ints cannot be part of a cycle, and CPython untracks such a tuple itself, but only when
 * a collection first walks it: until then every young collection walks all of them. A
 * gateway allocates few other tracked objects per turn, so young collections are seconds
 * apart and each walked hundreds of these tuples at once (3.3 million references, an 18 ms
 * pause of the event loop: docs/benchmarks.md, "Young collections walked every remembered
 * chat"). ``untracked_ints`` builds the tuple and untracks it at once, as the collector
 * would have. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

PyDoc_STRVAR(untracked_ints_doc,
"untracked_ints(ids) -> tuple\n\n"
"tuple(ids), every item an int, untracked by the cyclic garbage collector (a tuple of ints\n"
"holds no reference cycle). TypeError when an item is not an int.");

static PyObject *untracked_ints(PyObject *self, PyObject *arg) {
    (void)self;
    PyObject *t = PySequence_Tuple(arg);
    if (t == NULL) {
        return NULL;
    }
    Py_ssize_t n = PyTuple_GET_SIZE(t);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!PyLong_CheckExact(PyTuple_GET_ITEM(t, i))) {
            Py_DECREF(t);
            PyErr_SetString(PyExc_TypeError, "untracked_ints takes ints only");
            return NULL;
        }
    }
    if (PyObject_GC_IsTracked(t)) {
        PyObject_GC_UnTrack(t);
    }
    return t;
}

static PyMethodDef ids_methods[] = {
    {"untracked_ints", untracked_ints, METH_O, untracked_ints_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef ids_module = {
    PyModuleDef_HEAD_INIT,
    "gateway.tokenization._ids",
    "Tuples of token ids that the cyclic collector does not walk.",
    -1,
    ids_methods,
    NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__ids(void) {
    return PyModule_Create(&ids_module);
}
