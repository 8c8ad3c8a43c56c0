/* fastload.vision._jpegwin: decode only a window of a JPEG, optionally DCT-downscaled.
 *
 * libjpeg-turbo's partial decompression: jpeg_crop_scanline limits IDCT, upsampling and colour
 * conversion to the window's columns (widened to the iMCU grid, the extra columns dropped here),
 * jpeg_skip_scanlines skips the rows above it (entropy decoding only), and decoding stops after
 * its last row. scale_num/8 (1..8) scales in the DCT domain. Pixels are those of a full decode
 * at the same scale, cropped. A batch decodes in one call with the GIL released, each window
 * straight into the caller's buffer (optionally mirrored). Corrupt-data warnings are errors.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jpeglib.h>

#define ERR_DECODE 1
#define ERR_UNSUPPORTED 2

typedef struct {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    char message[JMSG_LENGTH_MAX];
} fl_error;

static void fl_error_exit(j_common_ptr cinfo) {
    fl_error *err = (fl_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void fl_emit_message(j_common_ptr cinfo, int level) {
    if (level < 0) { /* a corrupt-data warning: never hand back made-up pixels */
        fl_error_exit(cinfo);
    }
}

typedef struct {
    unsigned char *row;
    size_t cap;
} fl_scratch;

/* Decode window (y0, x0, h, w) of the image scaled by num/8 into dst (h * w * 3 bytes, RGB).
 * Returns 0, ERR_DECODE or ERR_UNSUPPORTED (CMYK/YCCK: the caller falls back), message in msg. */
static int fl_decode_one(const unsigned char *src, size_t len, long y0, long x0, long h, long w, int num,
                         int flip, unsigned char *dst, fl_scratch *scratch, char *msg) {
    struct jpeg_decompress_struct cinfo;
    fl_error err;
    volatile int created = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fl_error_exit;
    err.pub.emit_message = fl_emit_message;
    if (setjmp(err.jump)) {
        snprintf(msg, JMSG_LENGTH_MAX, "%s", err.message);
        if (created) jpeg_destroy_decompress(&cinfo);
        return ERR_DECODE;
    }
    jpeg_create_decompress(&cinfo);
    created = 1;
    jpeg_mem_src(&cinfo, src, (unsigned long)len);
    jpeg_read_header(&cinfo, TRUE);
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        snprintf(msg, JMSG_LENGTH_MAX, "CMYK/YCCK JPEG");
        jpeg_destroy_decompress(&cinfo);
        return ERR_UNSUPPORTED;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = (unsigned int)num;
    cinfo.scale_denom = 8;
    jpeg_start_decompress(&cinfo);
    if (y0 < 0 || x0 < 0 || h < 1 || w < 1 || (unsigned long)(y0 + h) > cinfo.output_height ||
        (unsigned long)(x0 + w) > cinfo.output_width) {
        snprintf(msg, JMSG_LENGTH_MAX, "window (y0=%ld, x0=%ld, h=%ld, w=%ld) outside the %ux%u decoded image",
                 y0, x0, h, w, cinfo.output_height, cinfo.output_width);
        jpeg_destroy_decompress(&cinfo);
        return ERR_DECODE;
    }
    /* One column of margin each side (libjpeg widens the left one to the iMCU grid): fancy
     * upsampling then sees the chroma neighbours a full decode sees, so edge pixels match. */
    long left = x0 > 0 ? x0 - 1 : 0, right = x0 + w + 1 < (long)cinfo.output_width ? x0 + w + 1 : (long)cinfo.output_width;
    JDIMENSION xoff = (JDIMENSION)left, cw = (JDIMENSION)(right - left);
    if (cw < cinfo.output_width) jpeg_crop_scanline(&cinfo, &xoff, &cw);
    size_t lead = (size_t)(x0 - (long)xoff) * 3, row_bytes = (size_t)w * 3;
    size_t need = (size_t)cinfo.output_width * 3;
    int direct = lead == 0 && cinfo.output_width == (JDIMENSION)w && !flip;
    if (!direct && scratch->cap < need) {
        unsigned char *grown = realloc(scratch->row, need);
        if (grown == NULL) {
            snprintf(msg, JMSG_LENGTH_MAX, "out of memory for a %zu-byte row", need);
            jpeg_destroy_decompress(&cinfo);
            return ERR_DECODE;
        }
        scratch->row = grown;
        scratch->cap = need;
    }
    if (y0 > 0) jpeg_skip_scanlines(&cinfo, (JDIMENSION)y0);
    for (long r = 0; r < h; r++) {
        unsigned char *out = dst + (size_t)r * row_bytes;
        JSAMPROW target = direct ? out : scratch->row;
        if (jpeg_read_scanlines(&cinfo, &target, 1) != 1) {
            snprintf(msg, JMSG_LENGTH_MAX, "decoder returned no row %ld", y0 + r);
            jpeg_destroy_decompress(&cinfo);
            return ERR_DECODE;
        }
        if (direct) continue;
        const unsigned char *in = scratch->row + lead;
        if (!flip) {
            memcpy(out, in, row_bytes);
        } else {
            for (long c = 0; c < w; c++) {
                const unsigned char *p = in + (size_t)(w - 1 - c) * 3;
                out[c * 3] = p[0];
                out[c * 3 + 1] = p[1];
                out[c * 3 + 2] = p[2];
            }
        }
    }
    jpeg_abort_decompress(&cinfo); /* the rows below the window are never decoded */
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

PyDoc_STRVAR(decode_windows_doc,
             "decode_windows(sources, params, outputs) -> list\n\n"
             "sources: n JPEG buffers; params: C-contiguous int64 buffer of n rows (y0, x0, h, w, num, flip),\n"
             "the window in pixels of the image decoded at scale num/8 (1..8); outputs: n writable\n"
             "C-contiguous buffers of h*w*3 bytes each (RGB, rows of w pixels). Returns a list with None\n"
             "per decoded image, else (code, message): code 1 a decode error, 2 an unsupported colour\n"
             "space (CMYK/YCCK). Runs without the GIL.");

static PyObject *decode_windows(PyObject *self, PyObject *args) {
    PyObject *sources, *outputs;
    Py_buffer params;
    if (!PyArg_ParseTuple(args, "Oy*O", &sources, &params, &outputs)) return NULL;
    PyObject *result = NULL, *src_seq = NULL, *out_seq = NULL;
    Py_buffer *bufs = NULL;
    int *codes = NULL;
    char *messages = NULL;
    Py_ssize_t n = 0, got_src = 0, got_out = 0;

    src_seq = PySequence_Fast(sources, "sources must be a sequence");
    out_seq = src_seq ? PySequence_Fast(outputs, "outputs must be a sequence") : NULL;
    if (out_seq == NULL) goto done;
    n = PySequence_Fast_GET_SIZE(src_seq);
    if (PySequence_Fast_GET_SIZE(out_seq) != n || params.len != n * 6 * (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "need one (y0, x0, h, w, num, flip) int64 row and one output per source");
        goto done;
    }
    const long long *p = (const long long *)params.buf;
    bufs = PyMem_Calloc((size_t)(2 * n + 1), sizeof(Py_buffer));
    codes = PyMem_Calloc((size_t)n + 1, sizeof(int));
    messages = PyMem_Calloc((size_t)n + 1, JMSG_LENGTH_MAX);
    if (bufs == NULL || codes == NULL || messages == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long *q = p + 6 * i;
        if (q[2] < 1 || q[3] < 1 || q[4] < 1 || q[4] > 8) {
            PyErr_Format(PyExc_ValueError, "row %zd: need h, w >= 1 and 1 <= num <= 8", i);
            goto done;
        }
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(src_seq, i), &bufs[i], PyBUF_SIMPLE) < 0) goto done;
        got_src++;
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(out_seq, i), &bufs[n + i], PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
            goto done;
        got_out++;
        if (bufs[n + i].len != (Py_ssize_t)(q[2] * q[3] * 3)) {
            PyErr_Format(PyExc_ValueError, "output %zd has %zd bytes, the window needs %lld", i, bufs[n + i].len,
                         q[2] * q[3] * 3);
            goto done;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    fl_scratch scratch = {NULL, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long *q = p + 6 * i;
        codes[i] = fl_decode_one((const unsigned char *)bufs[i].buf, (size_t)bufs[i].len, (long)q[0], (long)q[1],
                                 (long)q[2], (long)q[3], (int)q[4], q[5] != 0, (unsigned char *)bufs[n + i].buf,
                                 &scratch, messages + (size_t)i * JMSG_LENGTH_MAX);
    }
    free(scratch.row);
    Py_END_ALLOW_THREADS
    result = PyList_New(n);
    if (result == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item;
        if (codes[i] == 0) {
            item = Py_NewRef(Py_None);
        } else {
            item = Py_BuildValue("(is)", codes[i], messages + (size_t)i * JMSG_LENGTH_MAX);
            if (item == NULL) {
                Py_CLEAR(result);
                goto done;
            }
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    for (Py_ssize_t i = 0; i < got_src; i++) PyBuffer_Release(&bufs[i]);
    for (Py_ssize_t i = 0; i < got_out; i++) PyBuffer_Release(&bufs[n + i]);
    PyMem_Free(bufs);
    PyMem_Free(codes);
    PyMem_Free(messages);
    Py_XDECREF(src_seq);
    Py_XDECREF(out_seq);
    PyBuffer_Release(&params);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_windows", decode_windows, METH_VARARGS, decode_windows_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegwin", "Windowed, DCT-scaled JPEG decode (libjpeg-turbo).", -1, methods};

PyMODINIT_FUNC PyInit__jpegwin(void) { return PyModule_Create(&module); }
