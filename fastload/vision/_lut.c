/* fastload.vision._lut: uint8 RGB pixels -> per-channel table values (the normalising LUT).
 *
 * One pass over interleaved (N, H, W, 3) uint8 pixels writes (N, 3, H, W) or (N, H, W, 3) values
 * of 2, 4 or 8 bytes (the output dtype's bit patterns), without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define LUT_LOOP(T)                                                                              \
    do {                                                                                         \
        const T *t0 = (const T *)table, *t1 = t0 + 256, *t2 = t0 + 512;                          \
        T *o = (T *)out;                                                                         \
        for (Py_ssize_t k = 0; k < images; k++) {                                                \
            const uint8_t *s = src + (size_t)k * plane * 3;                                      \
            if (planar) {                                                                        \
                T *r = o + (size_t)k * plane * 3, *g = r + plane, *b = g + plane;                \
                for (Py_ssize_t p = 0; p < plane; p++) {                                         \
                    r[p] = t0[s[3 * p]];                                                         \
                    g[p] = t1[s[3 * p + 1]];                                                     \
                    b[p] = t2[s[3 * p + 2]];                                                     \
                }                                                                                \
            } else {                                                                             \
                T *d = o + (size_t)k * plane * 3;                                                \
                for (Py_ssize_t p = 0; p < plane; p++) {                                         \
                    d[3 * p] = t0[s[3 * p]];                                                     \
                    d[3 * p + 1] = t1[s[3 * p + 1]];                                             \
                    d[3 * p + 2] = t2[s[3 * p + 2]];                                             \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    } while (0)

PyDoc_STRVAR(apply_doc,
             "apply(src, table, out, images, plane, planar)\n\n"
             "src: C-contiguous uint8 buffer of images * plane * 3 bytes (HWC pixels); table: 3 x 256\n"
             "values of 2, 4 or 8 bytes (C-contiguous); out: writable buffer of images * plane * 3 values\n"
             "of the table's size, CHW per image when planar else HWC. Runs without the GIL.");

static PyObject *apply(PyObject *self, PyObject *args) {
    Py_buffer s, t, o;
    Py_ssize_t images, plane;
    int planar;
    if (!PyArg_ParseTuple(args, "y*y*w*nnp", &s, &t, &o, &images, &plane, &planar)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t item = t.len / (3 * 256);
    if (images < 0 || plane < 0 || (item != 2 && item != 4 && item != 8) || t.len != item * 3 * 256) {
        PyErr_SetString(PyExc_ValueError, "table must hold 3 x 256 values of 2, 4 or 8 bytes");
        goto done;
    }
    if (s.len != images * plane * 3 || o.len != images * plane * 3 * item) {
        PyErr_Format(PyExc_ValueError, "src has %zd bytes and out %zd for %zd images of %zd pixels", s.len, o.len,
                     images, plane);
        goto done;
    }
    const uint8_t *src = (const uint8_t *)s.buf;
    const void *table = t.buf;
    void *out = o.buf;
    Py_BEGIN_ALLOW_THREADS
    if (item == 2)
        LUT_LOOP(uint16_t);
    else if (item == 4)
        LUT_LOOP(uint32_t);
    else
        LUT_LOOP(uint64_t);
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&s);
    PyBuffer_Release(&t);
    PyBuffer_Release(&o);
    return result;
}

static PyMethodDef methods[] = {
    {"apply", apply, METH_VARARGS, apply_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_lut", "Per-channel lookup of uint8 RGB pixels.", -1, methods};

PyMODINIT_FUNC PyInit__lut(void) { return PyModule_Create(&module); }
