/* Token ids to little-endian int32 bytes: the fast paths of prefixcache.blocks.tokens for list
 * and int32 array input, built with the compiled core.
 *
 * pack_token_list(tokens) takes a list and returns the packed bytes when every item is a plain
 * int (exactly int: not a bool, not a numpy integer) in [0, 2**31); for anything else it
 * returns None and the Python path, which packs the general case, says what is wrong. No
 * Python code runs while it reads the list, so the list cannot change under it.
 *
 * int32_nonnegative(data) says whether every little-endian int32 in a bytes object is >= 0:
 * the range check of an int32 array's bytes, without a numpy reduction's fixed cost.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* TypeError "<function> expects <what>, got <type>"; returns NULL for the caller to return. */
static PyObject *
wrong_type(const char *function, const char *what, PyObject *got)
{
    PyErr_Format(PyExc_TypeError, "%s expects %s, got %s", function, what, Py_TYPE(got)->tp_name);
    return NULL;
}

static PyObject *
pack_token_list(PyObject *module, PyObject *tokens)
{
    (void)module;
    if (!PyList_CheckExact(tokens)) {
        return wrong_type("pack_token_list", "a list", tokens);
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

static PyObject *
int32_nonnegative(PyObject *module, PyObject *data)
{
    (void)module;
    if (!PyBytes_CheckExact(data)) {
        return wrong_type("int32_nonnegative", "bytes", data);
    }
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if (size % 4) {
        PyErr_SetString(PyExc_ValueError, "int32_nonnegative expects a multiple of 4 bytes");
        return NULL;
    }
    const unsigned char *in = (const unsigned char *)PyBytes_AS_STRING(data);
    unsigned char high = 0; /* OR of every value's most significant byte: its sign bit */
    for (Py_ssize_t i = 3; i < size; i += 4) {
        high |= in[i];
    }
    return PyBool_FromLong(!(high & 0x80));
}

static PyMethodDef token_pack_methods[] = {
    {"pack_token_list", pack_token_list, METH_O,
     "pack_token_list(tokens: list) -> bytes | None\n\n"
     "The ids as little-endian int32 bytes when every item is a plain int in [0, 2**31); "
     "None otherwise."},
    {"int32_nonnegative", int32_nonnegative, METH_O,
     "int32_nonnegative(data: bytes) -> bool\n\n"
     "Whether every little-endian int32 in ``data`` is >= 0."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef token_pack_module = {
    PyModuleDef_HEAD_INIT,
    "prefixcache.blocks._token_pack",
    "Token ids to int32 bytes and their range check (built with the compiled core).",
    -1,
    token_pack_methods,
};

PyMODINIT_FUNC
PyInit__token_pack(void)
{
    return PyModule_Create(&token_pack_module);
}
