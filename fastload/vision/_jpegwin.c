/* fastload.vision._jpegwin: decode only a window of a JPEG, optionally DCT-downscaled.
 *
 * libjpeg-turbo's partial decompression: jpeg_crop_scanline limits IDCT, upsampling and colour
 * conversion to the window's columns (widened to the iMCU grid, the extra columns dropped here),
 * jpeg_skip_scanlines skips the rows above it (entropy decoding only), and decoding stops after
 * its last row. scale_num/8 (1..8) scales in the DCT domain. Pixels are those of a full decode
 * at the same scale, cropped. A batch (a Ragged view: one values buffer + offsets) decodes in one
 * call with the GIL released, each window straight into its place in the caller's output buffer
 * (optionally mirrored); its headers are read the same way. Corrupt-data warnings are errors.
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

/* The sources as one values buffer + int64 offsets (a Ragged batch view): checks them. */
static int fl_check_offsets(const Py_buffer *values, const Py_buffer *offsets, Py_ssize_t *count) {
    if (offsets->len % (Py_ssize_t)sizeof(long long) != 0 || offsets->len < (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "offsets must be int64 with at least one entry");
        return -1;
    }
    const long long *o = (const long long *)offsets->buf;
    Py_ssize_t k = offsets->len / (Py_ssize_t)sizeof(long long) - 1;
    if (o[0] < 0 || o[k] > (long long)values->len) {
        PyErr_Format(PyExc_ValueError, "offsets span [%lld, %lld), values hold %zd bytes", o[0], o[k], values->len);
        return -1;
    }
    for (Py_ssize_t i = 0; i < k; i++) {
        if (o[i + 1] < o[i]) {
            PyErr_Format(PyExc_ValueError, "offsets decrease at %zd", i);
            return -1;
        }
    }
    *count = k;
    return 0;
}

PyDoc_STRVAR(decode_windows_doc,
             "decode_windows(values, offsets, params, out) -> list\n\n"
             "The sources are a Ragged batch view: source j is values[offsets[j]:offsets[j + 1]] (offsets:\n"
             "int64). params: C-contiguous int64 rows (src, y0, x0, h, w, num, flip, out_offset): decode\n"
             "source src's window (in pixels of the image decoded at scale num/8, 1..8), mirrored if flip,\n"
             "into out[out_offset : out_offset + h*w*3] (RGB, rows of w pixels); out: one writable\n"
             "C-contiguous buffer. Returns the failures only, as (row, code, message): code 1 a decode\n"
             "error, 2 an unsupported colour space (CMYK/YCCK). Runs without the GIL.");

static PyObject *decode_windows(PyObject *self, PyObject *args) {
    Py_buffer values, offsets, params, out;
    if (!PyArg_ParseTuple(args, "y*y*y*w*", &values, &offsets, &params, &out)) return NULL;
    PyObject *result = NULL;
    int *codes = NULL;
    char *messages = NULL;
    Py_ssize_t k = 0, n = params.len / (8 * (Py_ssize_t)sizeof(long long));
    if (fl_check_offsets(&values, &offsets, &k) < 0) goto done;
    if (params.len != n * 8 * (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "params must be int64 rows of (src, y0, x0, h, w, num, flip, out_offset)");
        goto done;
    }
    const long long *p = (const long long *)params.buf, *o = (const long long *)offsets.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long *q = p + 8 * i;
        if (q[0] < 0 || q[0] >= k) {
            PyErr_Format(PyExc_ValueError, "row %zd: source %lld of %zd", i, q[0], k);
            goto done;
        }
        if (q[3] < 1 || q[4] < 1 || q[3] > (1 << 16) || q[4] > (1 << 16) || q[5] < 1 || q[5] > 8) {
            PyErr_Format(PyExc_ValueError, "row %zd: need 1 <= h, w <= 65536 and 1 <= num <= 8", i);
            goto done;
        }
        if (q[7] < 0 || q[7] + q[3] * q[4] * 3 > (long long)out.len) {
            PyErr_Format(PyExc_ValueError, "row %zd: output bytes [%lld, %lld) outside the %zd-byte output", i, q[7],
                         q[7] + q[3] * q[4] * 3, out.len);
            goto done;
        }
    }
    codes = PyMem_Calloc((size_t)n + 1, sizeof(int));
    messages = PyMem_Calloc((size_t)n + 1, JMSG_LENGTH_MAX);
    if (codes == NULL || messages == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_BEGIN_ALLOW_THREADS
    fl_scratch scratch = {NULL, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long *q = p + 8 * i;
        const unsigned char *src = (const unsigned char *)values.buf + o[q[0]];
        codes[i] = fl_decode_one(src, (size_t)(o[q[0] + 1] - o[q[0]]), (long)q[1], (long)q[2], (long)q[3], (long)q[4],
                                 (int)q[5], q[6] != 0, (unsigned char *)out.buf + q[7], &scratch,
                                 messages + (size_t)i * JMSG_LENGTH_MAX);
    }
    free(scratch.row);
    Py_END_ALLOW_THREADS
    result = PyList_New(0);
    for (Py_ssize_t i = 0; result != NULL && i < n; i++) {
        if (codes[i] == 0) continue;
        PyObject *item = Py_BuildValue("(nis)", i, codes[i], messages + (size_t)i * JMSG_LENGTH_MAX);
        if (item == NULL || PyList_Append(result, item) < 0) Py_CLEAR(result);
        Py_XDECREF(item);
    }
done:
    PyMem_Free(codes);
    PyMem_Free(messages);
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&params);
    PyBuffer_Release(&out);
    return result;
}

/* (height, width) of a JPEG from its header; 0, 1 (no JPEG signature) or 2 (unreadable header). */
static int fl_header(const unsigned char *src, size_t len, long long *hw) {
    if (len < 3 || src[0] != 0xFF || src[1] != 0xD8 || src[2] != 0xFF) return 1;
    struct jpeg_decompress_struct cinfo;
    fl_error err;
    volatile int created = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fl_error_exit;
    err.pub.emit_message = fl_emit_message;
    if (setjmp(err.jump)) {
        if (created) jpeg_destroy_decompress(&cinfo);
        return 2;
    }
    jpeg_create_decompress(&cinfo);
    created = 1;
    jpeg_mem_src(&cinfo, src, (unsigned long)len);
    jpeg_read_header(&cinfo, TRUE);
    hw[0] = cinfo.image_height;
    hw[1] = cinfo.image_width;
    jpeg_destroy_decompress(&cinfo);
    return 0;
}

PyDoc_STRVAR(read_sizes_doc,
             "read_sizes(values, offsets, sizes) -> None\n\n"
             "For each source of the Ragged batch view (values, int64 offsets), reads the JPEG header into\n"
             "the writable int64 buffer sizes, one (height, width, code) row per source: code 0 read,\n"
             "1 not a JPEG (no FF D8 FF signature), 2 a header libjpeg rejects. Runs without the GIL.");

static PyObject *read_sizes(PyObject *self, PyObject *args) {
    Py_buffer values, offsets, sizes;
    if (!PyArg_ParseTuple(args, "y*y*w*", &values, &offsets, &sizes)) return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = 0;
    if (fl_check_offsets(&values, &offsets, &k) < 0) goto done;
    if (sizes.len != k * 3 * (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "sizes must hold one int64 (height, width, code) row per source");
        goto done;
    }
    const long long *o = (const long long *)offsets.buf;
    long long *rows = (long long *)sizes.buf;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < k; i++) {
        long long *r = rows + 3 * i;
        r[0] = r[1] = 0;
        r[2] = fl_header((const unsigned char *)values.buf + o[i], (size_t)(o[i + 1] - o[i]), r);
    }
    Py_END_ALLOW_THREADS
    result = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&values);
    PyBuffer_Release(&offsets);
    PyBuffer_Release(&sizes);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_windows", decode_windows, METH_VARARGS, decode_windows_doc},
    {"read_sizes", read_sizes, METH_VARARGS, read_sizes_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegwin", "Windowed, DCT-scaled JPEG decode (libjpeg-turbo).", -1, methods};

PyMODINIT_FUNC PyInit__jpegwin(void) { return PyModule_Create(&module); }
