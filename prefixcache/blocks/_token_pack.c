/* Token ids from a Python list to little-endian int32 bytes: the fast path of
 * prefixcache.blocks.tokens for list input, built with the compiled core.
 *
 * pack_token_list(tokens) takes a list and returns the packed bytes when every item is a plain
 * int (exactly int: not a bool, not a numpy integer) in [0, 2**31); for anything else it
 * returns None and the Python path, which packs the general case, says what is wrong. No
 * Python code runs while it reads the list, so the list cannot change under it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

static PyObject *
pack_token_list(PyObject *module, PyObject *tokens)
{
    (void)module;
    if (!PyList_CheckExact(tokens)) {
        PyErr_Format(PyExc_TypeError, "pack_token_list expects a list, got %s",
                     Py_TYPE(tokens)->tp_name);
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(tokens);
    PyObject *packed = PyBytes_FromStringAndSize(NULL, count * 4);
    if (packed == NULL) {
        return NULL;
    }
    unsigned char *out = (unsigned char *)PyBytes_AS_STRING(packed);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(tokens, i);
        if (!PyLong_CheckExact(item)) {
            goto general;
        }
        int overflow = 0;
        long value = PyLong_AsLongAndOverflow(item, &overflow);
        if (overflow || value < 0 || value > 0x7FFFFFFFL) {
            if (value == -1 && PyErr_Occurred()) { /* never for an exact int; to be safe */
                PyErr_Clear();
            }
            goto general;
        }
        uint32_t id = (uint32_t)value;
        out[0] = (unsigned char)id; /* little-endian whatever the host's order */
        out[1] = (unsigned char)(id >> 8);
        out[2] = (unsigned char)(id >> 16);
        out[3] = (unsigned char)(id >> 24);
        out += 4;
    }
    return packed;

general:
    Py_DECREF(packed);
    Py_RETURN_NONE;
}

static PyMethodDef token_pack_methods[] = {
    {"pack_token_list", pack_token_list, METH_O,
     "pack_token_list(tokens: list) -> bytes | None\n\n"
     "The ids as little-endian int32 bytes when every item is a plain int in [0, 2**31); "
     "None otherwise."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef token_pack_module = {
    PyModuleDef_HEAD_INIT,
    "prefixcache.blocks._token_pack",
    "Token ids from a list to int32 bytes (built with the compiled core).",
    -1,
    token_pack_methods,
};

PyMODINIT_FUNC
PyInit__token_pack(void)
{
    return PyModule_Create(&token_pack_module);
}
