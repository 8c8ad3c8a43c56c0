/* fastload.vision._jpegwin: decode only a window of a JPEG, optionally DCT-downscaled.
 *
 * libjpeg-turbo's partial decompression: jpeg_crop_scanline limits IDCT, upsampling and colour
 * conversion to the window's columns (widened to the iMCU grid, the extra columns dropped here),
 * jpeg_skip_scanlines skips the rows above it (entropy decoding only), and decoding stops after
 * its last row. scale_num/8 (1..8) scales in the DCT domain. Pixels are those of a full decode
 * at the same scale, cropped. A batch (a Ragged view: one values buffer + offsets) decodes in one
 * call with the GIL released, each window straight into its place in the caller's output buffer
 * (optionally mirrored); its headers are read the same way. Corrupt-data warnings are errors.
 *
 * Restart index: a baseline JPEG with a restart marker after every MCU row and an APP9 "FLRST"
 * segment listing where each restart interval starts (written at conversion by transcode_restart,
 * a lossless re-encode of the DCT coefficients; layout in formats/FORMAT.md) is decoded from the
 * restart interval holding the window's first row: the decoder gets a stream made of the header
 * (SOF height cut to the rows kept) and the entropy-coded data of the window's intervals only,
 * restart markers renumbered from RST0, so the rows above the window are never entropy-decoded.
 * With vertically subsampled chroma, a window starting (ending) on an MCU row's first (last) row
 * also takes the MCU row above (below): fancy upsampling blends each chroma row with its
 * neighbour. Every offset of the index is checked (inside the data, increasing, on a restart
 * marker of the expected number) before one is used; an index that fails any check, or an image
 * without one, takes the whole-stream path.
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
    unsigned char *stream; /* the cut stream of the restart path */
    size_t stream_cap;
} fl_scratch;

#define FL_INDEX_ID "FLRST" /* + NUL: the APP9 restart-index segment (formats/FORMAT.md) */
#define FL_INDEX_HEAD 8     /* "FLRST\0", version 1, MCU rows per restart interval (1) */
#define FL_MAX_INDEX 16381  /* uint32 offsets that fit one segment (65533 - 8 bytes) */

/* Where a JPEG's parts are: the SOF0/SOF1 segment, the restart index, the entropy-coded data. */
typedef struct {
    size_t sof;               /* offset of the SOF marker (FF C0 / FF C1); 0: none */
    size_t entropy;           /* first byte after the SOS segment */
    const unsigned char *idx; /* the APP9 FLRST payload (after the identifier), or NULL */
    size_t idx_len;
} fl_layout;

static unsigned long fl_be32(const unsigned char *p) {
    return ((unsigned long)p[0] << 24) | ((unsigned long)p[1] << 16) | ((unsigned long)p[2] << 8) | p[3];
}

/* Walks the marker segments from SOI to the first SOS, every length bounds-checked. Returns 1 for
 * a Huffman-coded sequential (SOF0/SOF1) image whose segments all lie inside the data, else 0. */
static int fl_scan_layout(const unsigned char *s, size_t len, fl_layout *lay) {
    memset(lay, 0, sizeof(*lay));
    if (len < 4 || s[0] != 0xFF || s[1] != 0xD8) return 0;
    size_t p = 2;
    while (p + 4 <= len) {
        if (s[p] != 0xFF) return 0;
        unsigned m = s[p + 1];
        if (m == 0xFF) { /* fill byte */
            p++;
            continue;
        }
        if (m == 0x00 || m == 0x01 || (m >= 0xD0 && m <= 0xD9)) return 0; /* no standalone markers before SOS */
        size_t seg = ((size_t)s[p + 2] << 8) | s[p + 3];
        if (seg < 2 || p + 2 + seg > len) return 0;
        if (m == 0xC0 || m == 0xC1) {
            if (lay->sof != 0 || seg < 8) return 0;
            lay->sof = p;
        } else if (m >= 0xC2 && m <= 0xCF && m != 0xC4 && m != 0xC8 && m != 0xCC) {
            return 0; /* progressive, lossless, arithmetic-coded or hierarchical */
        } else if (m == 0xE9 && seg >= 2 + FL_INDEX_HEAD && memcmp(s + p + 4, FL_INDEX_ID, 6) == 0) {
            if (lay->idx != NULL) return 0;
            lay->idx = s + p + 4 + FL_INDEX_HEAD;
            lay->idx_len = seg - 2 - FL_INDEX_HEAD;
            if (s[p + 4 + 6] != 1 || s[p + 4 + 7] != 1 || lay->idx_len % 4 != 0) return 0; /* version, rows */
        } else if (m == 0xDA) {
            lay->entropy = p + 2 + seg;
            return lay->sof != 0;
        }
        p += 2 + seg;
    }
    return 0;
}

/* The MCU geometry of the image's one scan: image rows per MCU row (mcu_h) and MCU rows. Returns 0
 * unless the scan is Huffman-coded, sequential and holds every component, and restarts come once
 * per MCU row. Needs jpeg_read_header's fields. */
static int fl_mcu_rows(const struct jpeg_decompress_struct *cinfo, long *mcu_h, long *rows) {
    if (cinfo->progressive_mode || cinfo->arith_code || cinfo->comps_in_scan != cinfo->num_components) return 0;
    long w = (long)cinfo->image_width, h = (long)cinfo->image_height, per_row;
    if (cinfo->num_components == 1) {
        *mcu_h = 8;
        per_row = (w + 7) / 8;
    } else {
        *mcu_h = 8L * cinfo->max_v_samp_factor;
        per_row = (w + 8L * cinfo->max_h_samp_factor - 1) / (8L * cinfo->max_h_samp_factor);
    }
    *rows = (h + *mcu_h - 1) / *mcu_h;
    return per_row > 0 && cinfo->restart_interval == (unsigned int)per_row;
}

/* Checks a restart index against the data: one offset per restart marker (rows - 1 of them),
 * increasing, each the byte after a marker FF D0+((j-1) % 8) inside the entropy-coded data.
 * Returns 1 if every offset is sound. */
static int fl_check_index(const unsigned char *s, size_t len, const fl_layout *lay, long rows) {
    if (lay->idx == NULL || (long)(lay->idx_len / 4) != rows - 1) return 0;
    unsigned long prev = 1;
    for (long j = 1; j < rows; j++) {
        unsigned long off = fl_be32(lay->idx + 4 * (j - 1));
        if (off < prev + 2 || off > len - lay->entropy) return 0;
        const unsigned char *at = s + lay->entropy + off;
        if (at[-2] != 0xFF || at[-1] != (unsigned char)(0xD0 + ((j - 1) & 7))) return 0;
        prev = off;
    }
    return 1;
}

/* The restart path: if the image carries a sound restart index and starting at a later restart
 * interval skips rows, builds in scratch->stream the cut stream for output rows [y0, y0 + h) at
 * scale num/8 (see the top of this file) and returns 1 with *stream_len and *row_shift (output
 * rows dropped above); else 0 (decode the whole stream). */
static int fl_cut_stream(const unsigned char *s, size_t len, const struct jpeg_decompress_struct *cinfo, long y0,
                         long h, int num, fl_scratch *scratch, size_t *stream_len, long *row_shift) {
    fl_layout lay;
    long mcu_h, rows;
    if (!fl_scan_layout(s, len, &lay) || lay.idx == NULL || !fl_mcu_rows(cinfo, &mcu_h, &rows)) return 0;
    long step = mcu_h * num / 8; /* output rows per MCU row: mcu_h is a multiple of 8 */
    /* Vertically subsampled chroma, fancy-upsampled: an output row blends its chroma row with the
     * one above (the upper row of a pair) or below (the lower one), so a window starting on the
     * first row of an MCU row needs the MCU row above, one ending on the last row the one below. */
    int vsub = cinfo->max_v_samp_factor > 1;
    long first = y0 / step - (vsub && y0 % step == 0);
    long end = (y0 + h - 1) / step + 1 + (vsub && (y0 + h) % step == 0);
    if (first < 1) return 0;
    if (end > rows) end = rows;
    if (!fl_check_index(s, len, &lay, rows)) return 0;
    const unsigned char *idx = lay.idx;
    size_t from = lay.entropy + fl_be32(idx + 4 * (first - 1));
    size_t to = end == rows ? len : lay.entropy + fl_be32(idx + 4 * (end - 1)) - 2;
    size_t need = lay.entropy + (to - from) + 2;
    if (scratch->stream_cap < need) {
        unsigned char *grown = realloc(scratch->stream, need);
        if (grown == NULL) return 0;
        scratch->stream = grown;
        scratch->stream_cap = need;
    }
    unsigned char *out = scratch->stream;
    memcpy(out, s, lay.entropy);
    memcpy(out + lay.entropy, s + from, to - from);
    size_t n = lay.entropy + (to - from);
    if (end < rows) { /* the data stops before the next restart marker: end the image there */
        out[n++] = 0xFF;
        out[n++] = 0xD9;
    }
    long kept = (end * mcu_h < (long)cinfo->image_height ? end * mcu_h : (long)cinfo->image_height) - first * mcu_h;
    out[lay.sof + 5] = (unsigned char)(kept >> 8);
    out[lay.sof + 6] = (unsigned char)(kept & 0xFF);
    for (long j = first + 1; j < end; j++) { /* markers numbered from RST0 again */
        size_t at = lay.entropy + (fl_be32(idx + 4 * (j - 1)) - 1) - (from - lay.entropy) ;
        out[at] = (unsigned char)(0xD0 + ((j - first - 1) & 7));
    }
    *stream_len = n;
    *row_shift = first * step;
    return 1;
}

/* Decode window (y0, x0, h, w) of the image scaled by num/8 into dst (h * w * 3 bytes, RGB).
 * Returns 0, ERR_DECODE or ERR_UNSUPPORTED (CMYK/YCCK: the caller falls back), message in msg. */
static int fl_decode_one(const unsigned char *src, size_t len, long y0, long x0, long h, long w, int num,
                         int flip, unsigned char *dst, fl_scratch *scratch, char *msg, unsigned char *started) {
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
    jpeg_calc_output_dimensions(&cinfo);
    if (y0 < 0 || x0 < 0 || h < 1 || w < 1 || (unsigned long)(y0 + h) > cinfo.output_height ||
        (unsigned long)(x0 + w) > cinfo.output_width) {
        snprintf(msg, JMSG_LENGTH_MAX, "window (y0=%ld, x0=%ld, h=%ld, w=%ld) outside the %ux%u decoded image",
                 y0, x0, h, w, cinfo.output_height, cinfo.output_width);
        jpeg_destroy_decompress(&cinfo);
        return ERR_DECODE;
    }
    size_t cut_len = 0;
    long row_shift = 0;
    if (fl_cut_stream(src, len, &cinfo, y0, h, num, scratch, &cut_len, &row_shift)) {
        jpeg_abort_decompress(&cinfo); /* the same object reads the cut stream */
        jpeg_mem_src(&cinfo, scratch->stream, (unsigned long)cut_len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = (unsigned int)num;
        cinfo.scale_denom = 8;
        y0 -= row_shift;
        *started = 1;
    }
    jpeg_start_decompress(&cinfo);
    /* One column of margin each side (libjpeg widens the left one to the iMCU grid): fancy
     * upsampling then sees the chroma neighbours a full decode sees, so edge pixels match. */
    long left = x0 > 0 ? x0 - 1 : 0, right = x0 + w + 1 < (long)cinfo.output_width ? x0 + w + 1 : (long)cinfo.output_width;
    /* At least 4 columns: libjpeg-turbo's h2 fancy upsampling of a 1-column chroma crop reads past it. */
    if (right - left < 4) right = left + 4 < (long)cinfo.output_width ? left + 4 : (long)cinfo.output_width;
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
             "decode_windows(values, offsets, params, out, starts=None) -> list\n\n"
             "The sources are a Ragged batch view: source j is values[offsets[j]:offsets[j + 1]] (offsets:\n"
             "int64). params: C-contiguous int64 rows (src, y0, x0, h, w, num, flip, out_offset): decode\n"
             "source src's window (in pixels of the image decoded at scale num/8, 1..8), mirrored if flip,\n"
             "into out[out_offset : out_offset + h*w*3] (RGB, rows of w pixels); out: one writable\n"
             "C-contiguous buffer. Returns the failures only, as (row, code, message): code 1 a decode\n"
             "error, 2 an unsupported colour space (CMYK/YCCK). starts, if given: one writable byte per row,\n"
             "set to 1 where the decode started at a restart interval (the image's restart index), else 0.\n"
             "Runs without the GIL.");

static PyObject *decode_windows(PyObject *self, PyObject *args) {
    Py_buffer values, offsets, params, out, starts = {0};
    if (!PyArg_ParseTuple(args, "y*y*y*w*|w*", &values, &offsets, &params, &out, &starts)) return NULL;
    PyObject *result = NULL;
    int *codes = NULL;
    char *messages = NULL;
    Py_ssize_t k = 0, n = params.len / (8 * (Py_ssize_t)sizeof(long long));
    if (fl_check_offsets(&values, &offsets, &k) < 0) goto done;
    if (params.len != n * 8 * (Py_ssize_t)sizeof(long long)) {
        PyErr_SetString(PyExc_ValueError, "params must be int64 rows of (src, y0, x0, h, w, num, flip, out_offset)");
        goto done;
    }
    if (starts.obj != NULL && starts.len != n) {
        PyErr_Format(PyExc_ValueError, "starts holds %zd bytes for %zd rows", starts.len, n);
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
    fl_scratch scratch = {NULL, 0, NULL, 0};
    for (Py_ssize_t i = 0; i < n; i++) {
        const long long *q = p + 8 * i;
        const unsigned char *src = (const unsigned char *)values.buf + o[q[0]];
        unsigned char started = 0;
        codes[i] = fl_decode_one(src, (size_t)(o[q[0] + 1] - o[q[0]]), (long)q[1], (long)q[2], (long)q[3], (long)q[4],
                                 (int)q[5], q[6] != 0, (unsigned char *)out.buf + q[7], &scratch,
                                 messages + (size_t)i * JMSG_LENGTH_MAX, &started);
        if (starts.obj != NULL) ((unsigned char *)starts.buf)[i] = started;
    }
    free(scratch.row);
    free(scratch.stream);
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
    if (starts.obj != NULL) PyBuffer_Release(&starts);
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

/* Entropy-coded data of out (from lay->entropy): the offset after each restart marker (at most
 * FL_MAX_INDEX, into offs); returns their count, or -1 if the data holds another marker before EOI. */
static long fl_find_restarts(const unsigned char *s, size_t len, size_t entropy, unsigned long *offs) {
    long count = 0;
    for (size_t p = entropy; p + 1 < len; p++) {
        if (s[p] != 0xFF) continue;
        unsigned m = s[p + 1];
        if (m == 0x00 || m == 0xFF) continue; /* a stuffed zero, or a fill byte */
        if (m == 0xD9) return count;
        if (m < 0xD0 || m > 0xD7 || count == FL_MAX_INDEX) return -1;
        offs[count++] = (unsigned long)(p + 2 - entropy);
        p++;
    }
    return -1;
}

/* Re-encodes src losslessly (its DCT coefficients, quantisation tables and sampling copied;
 * Huffman tables optimised; progressive input written as baseline) with a restart marker after
 * every MCU row, APPn/COM markers kept (an old restart index dropped), and the APP9 restart index
 * written after the APPn segments that follow SOI. Returns 0 with out and out_len set (malloc), else -1 with a message in msg. */
static int fl_transcode(const unsigned char *src, size_t len, unsigned char **out, size_t *out_len, char *msg) {
    struct jpeg_decompress_struct din;
    struct jpeg_compress_struct cout;
    fl_error err;
    volatile int made_in = 0, made_out = 0;
    unsigned char *enc = NULL;
    unsigned long enc_len = 0;
    unsigned long *offs = NULL;
    din.err = jpeg_std_error(&err.pub);
    cout.err = din.err;
    err.pub.error_exit = fl_error_exit;
    err.pub.emit_message = fl_emit_message;
    if (setjmp(err.jump)) {
        snprintf(msg, JMSG_LENGTH_MAX, "%s", err.message);
        if (made_out) jpeg_destroy_compress(&cout);
        if (made_in) jpeg_destroy_decompress(&din);
        free(enc);
        return -1;
    }
    jpeg_create_decompress(&din);
    made_in = 1;
    jpeg_mem_src(&din, src, (unsigned long)len);
    jpeg_save_markers(&din, JPEG_COM, 0xFFFF);
    for (int m = 0; m < 16; m++) jpeg_save_markers(&din, JPEG_APP0 + m, 0xFFFF);
    jpeg_read_header(&din, TRUE);
    jvirt_barray_ptr *coefs = jpeg_read_coefficients(&din);
    jpeg_create_compress(&cout);
    made_out = 1;
    jpeg_mem_dest(&cout, &enc, &enc_len);
    jpeg_copy_critical_parameters(&din, &cout);
    cout.restart_in_rows = 1;
    cout.optimize_coding = TRUE;
    jpeg_write_coefficients(&cout, coefs);
    for (jpeg_saved_marker_ptr m = din.marker_list; m != NULL; m = m->next) {
        const unsigned char *d = m->data;
        unsigned n = m->data_length;
        if (cout.write_JFIF_header && m->marker == JPEG_APP0 && n >= 5 && memcmp(d, "JFIF", 5) == 0) continue;
        if (cout.write_Adobe_marker && m->marker == JPEG_APP0 + 14 && n >= 5 && memcmp(d, "Adobe", 5) == 0) continue;
        if (m->marker == JPEG_APP0 + 9 && n >= 6 && memcmp(d, FL_INDEX_ID, 6) == 0) continue;
        jpeg_write_marker(&cout, m->marker, d, n);
    }
    jpeg_finish_compress(&cout);
    long mcu_h = din.num_components == 1 ? 8 : 8L * din.max_v_samp_factor;
    long rows = ((long)din.image_height + mcu_h - 1) / mcu_h;
    jpeg_destroy_compress(&cout);
    made_out = 0;
    jpeg_finish_decompress(&din);
    jpeg_destroy_decompress(&din);
    made_in = 0;

    fl_layout lay;
    long count = -1;
    offs = malloc(sizeof(unsigned long) * FL_MAX_INDEX);
    if (offs != NULL && fl_scan_layout(enc, enc_len, &lay)) count = fl_find_restarts(enc, enc_len, lay.entropy, offs);
    if (count != rows - 1) {
        snprintf(msg, JMSG_LENGTH_MAX, "the re-encoded image has %ld restart markers, expected %ld", count, rows - 1);
        free(offs);
        free(enc);
        return -1;
    }
    /* The index goes after the APPn segments that follow SOI (JFIF's APP0 and EXIF's APP1 stay first). */
    size_t at = 2;
    while (at + 4 <= lay.entropy && enc[at] == 0xFF && enc[at + 1] >= 0xE0 && enc[at + 1] <= 0xEF)
        at += 2 + (((size_t)enc[at + 2] << 8) | enc[at + 3]);
    size_t seg = 2 + FL_INDEX_HEAD + 4 * (size_t)count;
    *out_len = enc_len + 2 + seg;
    *out = malloc(*out_len);
    if (*out == NULL) {
        snprintf(msg, JMSG_LENGTH_MAX, "out of memory for %zu bytes", *out_len);
        free(offs);
        free(enc);
        return -1;
    }
    memcpy(*out, enc, at);
    unsigned char *o = *out + at;
    o[0] = 0xFF, o[1] = 0xE9, o[2] = (unsigned char)(seg >> 8), o[3] = (unsigned char)seg;
    memcpy(o + 4, FL_INDEX_ID, 6);
    o[10] = 1; /* version */
    o[11] = 1; /* MCU rows per restart interval */
    for (long j = 0; j < count; j++) {
        unsigned char *q = o + 12 + 4 * j;
        q[0] = (unsigned char)(offs[j] >> 24), q[1] = (unsigned char)(offs[j] >> 16);
        q[2] = (unsigned char)(offs[j] >> 8), q[3] = (unsigned char)offs[j];
    }
    memcpy(o + 2 + seg, enc + at, enc_len - at);
    free(offs);
    free(enc);
    return 0;
}

PyDoc_STRVAR(transcode_restart_doc,
             "transcode_restart(data) -> bytes\n\n"
             "A JPEG re-encoded losslessly (same DCT coefficients: a decoder gives the same pixels) as a\n"
             "baseline JPEG with a restart marker after every MCU row and the APP9 'FLRST' restart index\n"
             "(formats/FORMAT.md); Huffman tables optimised, APPn/COM markers kept. Raises ValueError with\n"
             "libjpeg's message when the data is not a JPEG it can re-encode (corrupt data included).\n"
             "Runs without the GIL.");

static PyObject *transcode_restart(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    unsigned char *out = NULL;
    size_t out_len = 0;
    char msg[JMSG_LENGTH_MAX];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fl_transcode((const unsigned char *)data.buf, (size_t)data.len, &out, &out_len, msg);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    if (rc != 0) {
        PyErr_SetString(PyExc_ValueError, msg);
        return NULL;
    }
    PyObject *result = PyBytes_FromStringAndSize((const char *)out, (Py_ssize_t)out_len);
    free(out);
    return result;
}

PyDoc_STRVAR(restart_index_doc,
             "restart_index(data) -> tuple | None\n\n"
             "The restart-interval offsets a JPEG's APP9 'FLRST' index lists (each the byte after a restart\n"
             "marker, counted from the start of the entropy-coded data), if the index passes every check the\n"
             "window decoder makes before using it (offsets inside the data, increasing, each on the restart\n"
             "marker expected, one per MCU row but the first); None otherwise (the decoder then reads the\n"
             "whole stream).");

static PyObject *restart_index(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    const unsigned char *s = (const unsigned char *)data.buf;
    size_t len = (size_t)data.len;
    fl_layout lay;
    struct jpeg_decompress_struct cinfo;
    fl_error err;
    volatile int created = 0, sound = 0;
    long mcu_h = 0, rows = 0;
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = fl_error_exit;
    err.pub.emit_message = fl_emit_message;
    if (setjmp(err.jump)) {
        sound = 0;
    } else if (fl_scan_layout(s, len, &lay) && lay.idx != NULL) {
        jpeg_create_decompress(&cinfo);
        created = 1;
        jpeg_mem_src(&cinfo, s, (unsigned long)len);
        jpeg_read_header(&cinfo, TRUE);
        sound = fl_mcu_rows(&cinfo, &mcu_h, &rows) && fl_check_index(s, len, &lay, rows);
    }
    if (created) jpeg_destroy_decompress(&cinfo);
    PyObject *result;
    if (!sound) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyTuple_New(rows - 1);
        for (long j = 0; result != NULL && j < rows - 1; j++) {
            PyObject *v = PyLong_FromUnsignedLong(fl_be32(lay.idx + 4 * j));
            if (v == NULL) Py_CLEAR(result);
            else PyTuple_SET_ITEM(result, j, v);
        }
    }
    PyBuffer_Release(&data);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_windows", decode_windows, METH_VARARGS, decode_windows_doc},
    {"read_sizes", read_sizes, METH_VARARGS, read_sizes_doc},
    {"transcode_restart", transcode_restart, METH_VARARGS, transcode_restart_doc},
    {"restart_index", restart_index, METH_VARARGS, restart_index_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegwin", "Windowed, DCT-scaled JPEG decode (libjpeg-turbo).", -1, methods};

PyMODINIT_FUNC PyInit__jpegwin(void) { return PyModule_Create(&module); }
