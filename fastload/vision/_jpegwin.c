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
 * Restart index: a baseline JPEG whose restart intervals tile the image (each MCU row cut into
 * equal column groups of R MCUs: DRI = R, R dividing the MCUs per row; version 1 of the index: one
 * interval per MCU row) and an APP9 "FLRST" segment listing where each restart interval starts
 * (written at conversion by transcode_restart, a lossless re-encode of the DCT coefficients; layout
 * in formats/FORMAT.md) is decoded from the intervals the window covers only: the decoder gets a
 * stream made of the header (SOF height and width cut to the MCU rows and column groups kept) and
 * the entropy-coded data of those intervals, restart markers renumbered from RST0, so neither the
 * rows above the window nor the column groups beside it are entropy-decoded. With subsampled
 * chroma, a window starting (ending) on an MCU row's or column group's first (last) pixel also
 * takes the row or group before (after) it: fancy upsampling blends each chroma sample with its
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
#define FL_INDEX_HEAD_V1 8  /* "FLRST\0", version 1, MCU rows per restart interval (1) */
#define FL_INDEX_HEAD 10    /* "FLRST\0", version 2, MCU rows per interval (1), u16 MCUs per interval */
#define FL_MAX_INDEX 16380  /* uint32 offsets that fit one segment (65533 - 10 bytes) */
#define FL_GROUP_PIXELS 64  /* the column group the transcoder aims at, in image pixels */

/* Where a JPEG's parts are: the SOF0/SOF1 segment, the restart index, the entropy-coded data. */
typedef struct {
    size_t sof;               /* offset of the SOF marker (FF C0 / FF C1); 0: none */
    size_t entropy;           /* first byte after the SOS segment */
    const unsigned char *idx; /* the APP9 FLRST offsets (after the index's head), or NULL */
    size_t idx_len;
    long interval;            /* MCUs per restart interval the index states; 0: one MCU row (version 1) */
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
        } else if (m == 0xE9 && seg >= 2 + FL_INDEX_HEAD_V1 && memcmp(s + p + 4, FL_INDEX_ID, 6) == 0) {
            const unsigned char *head = s + p + 4;
            if (lay->idx != NULL || head[7] != 1) return 0; /* one index; one MCU row per interval (row) */
            size_t at = FL_INDEX_HEAD_V1;
            if (head[6] == 2) {
                if (seg < 2 + FL_INDEX_HEAD) return 0;
                lay->interval = ((long)head[8] << 8) | head[9];
                if (lay->interval < 1) return 0;
                at = FL_INDEX_HEAD;
            } else if (head[6] != 1) {
                return 0;
            }
            lay->idx = head + at;
            lay->idx_len = seg - 2 - at;
            if (lay->idx_len % 4 != 0) return 0;
        } else if (m == 0xDA) {
            lay->entropy = p + 2 + seg;
            return lay->sof != 0;
        }
        p += 2 + seg;
    }
    return 0;
}

/* The MCU grid of an image's one interleaved scan. */
typedef struct {
    long mcu_h, mcu_w; /* image rows and columns per MCU */
    long rows, per_row; /* MCU rows; MCUs per row */
} fl_grid;

/* The MCU grid from the image's size and sampling (before any scan is read). */
static void fl_grid_of(const struct jpeg_decompress_struct *cinfo, fl_grid *g) {
    int gray = cinfo->num_components == 1;
    g->mcu_h = gray ? 8 : 8L * cinfo->max_v_samp_factor;
    g->mcu_w = gray ? 8 : 8L * cinfo->max_h_samp_factor;
    g->rows = ((long)cinfo->image_height + g->mcu_h - 1) / g->mcu_h;
    g->per_row = ((long)cinfo->image_width + g->mcu_w - 1) / g->mcu_w;
}

/* The MCU grid and the column groups of an image with a restart index: MCUs per restart interval
 * (*interval, the index's; one MCU row for a version 1 index). Returns 0 unless the scan is
 * Huffman-coded, sequential and holds every component, and the restart intervals tile the MCU
 * rows as the index says. Needs jpeg_read_header's fields. */
static int fl_restart_grid(const struct jpeg_decompress_struct *cinfo, const fl_layout *lay, fl_grid *g,
                           long *interval) {
    if (cinfo->progressive_mode || cinfo->arith_code || cinfo->comps_in_scan != cinfo->num_components) return 0;
    fl_grid_of(cinfo, g);
    *interval = lay->interval > 0 ? lay->interval : g->per_row;
    return g->per_row > 0 && g->per_row % *interval == 0 && cinfo->restart_interval == (unsigned int)*interval;
}

/* Checks a restart index against the data: one offset per restart marker (intervals - 1 of them),
 * increasing, each the byte after a marker FF D0+((j-1) % 8) inside the entropy-coded data.
 * Returns 1 if every offset is sound. */
static int fl_check_index(const unsigned char *s, size_t len, const fl_layout *lay, long intervals) {
    if (lay->idx == NULL || (long)(lay->idx_len / 4) != intervals - 1) return 0;
    unsigned long prev = 1;
    for (long j = 1; j < intervals; j++) {
        unsigned long off = fl_be32(lay->idx + 4 * (j - 1));
        if (off < prev + 2 || off > len - lay->entropy) return 0;
        const unsigned char *at = s + lay->entropy + off;
        if (at[-2] != 0xFF || at[-1] != (unsigned char)(0xD0 + ((j - 1) & 7))) return 0;
        prev = off;
    }
    return 1;
}

/* The first and end (exclusive) of the n cells of `step` output pixels that hold pixels
 * [a, a + len); with subsampled chroma (sub), a range starting (ending) on a cell's first (last)
 * pixel also takes the cell before (after): fancy upsampling blends each chroma sample with its
 * neighbour. */
static void fl_cells(long a, long len, long step, int sub, long n, long *first, long *end) {
    *first = a / step - (sub && a % step == 0);
    *end = (a + len - 1) / step + 1 + (sub && (a + len) % step == 0);
    if (*first < 0) *first = 0;
    if (*end > n) *end = n;
}

/* The restart path: if the image carries a sound restart index and starting at a later restart
 * interval, or leaving column groups out, skips data, builds in scratch->stream the cut stream for
 * output window (y0, x0, h, w) at scale num/8 (see the top of this file) and returns 1 with
 * *stream_len and the output rows (*row_shift) and columns (*col_shift) dropped above and left of
 * it; else 0 (decode the whole stream). */
static int fl_cut_stream(const unsigned char *s, size_t len, const struct jpeg_decompress_struct *cinfo, long y0,
                         long x0, long h, long w, int num, fl_scratch *scratch, size_t *stream_len, long *row_shift,
                         long *col_shift) {
    fl_layout lay;
    fl_grid g;
    long interval;
    if (!fl_scan_layout(s, len, &lay) || lay.idx == NULL || !fl_restart_grid(cinfo, &lay, &g, &interval)) return 0;
    long groups = g.per_row / interval, total = g.rows * groups;
    long step = g.mcu_h * num / 8, stepx = interval * g.mcu_w * num / 8; /* mcu_h, mcu_w: multiples of 8 */
    long first, end, g0, g1;
    fl_cells(y0, h, step, cinfo->max_v_samp_factor > 1, g.rows, &first, &end);
    fl_cells(x0, w, stepx, cinfo->max_h_samp_factor > 1, groups, &g0, &g1);
    if (first == 0 && g0 == 0 && g1 == groups) return 0; /* nothing above or beside: the whole stream */
    if (!fl_check_index(s, len, &lay, total)) return 0;
    const unsigned char *idx = lay.idx;
    size_t need = lay.entropy + (len - lay.entropy) + 2 * (size_t)((end - first) * (g1 - g0)) + 2;
    if (scratch->stream_cap < need) {
        unsigned char *grown = realloc(scratch->stream, need);
        if (grown == NULL) return 0;
        scratch->stream = grown;
        scratch->stream_cap = need;
    }
    unsigned char *out = scratch->stream;
    memcpy(out, s, lay.entropy);
    size_t n = lay.entropy;
    long written = 0, last = 0;
    for (long r = first; r < end; r++) {
        for (long c = g0; c < g1; c++) {
            long k = r * groups + c; /* interval k: from the byte after marker k - 1 to its own marker */
            size_t from = k == 0 ? lay.entropy : lay.entropy + fl_be32(idx + 4 * (k - 1));
            size_t to = k == total - 1 ? len : lay.entropy + fl_be32(idx + 4 * k) - 2;
            if (written > 0) { /* markers numbered from RST0 again */
                out[n++] = 0xFF;
                out[n++] = (unsigned char)(0xD0 + ((written - 1) & 7));
            }
            memcpy(out + n, s + from, to - from);
            n += to - from;
            written++;
            last = k;
        }
    }
    if (last != total - 1) { /* the data stops before the next restart marker: end the image there */
        out[n++] = 0xFF;
        out[n++] = 0xD9;
    }
    long bottom = end * g.mcu_h < (long)cinfo->image_height ? end * g.mcu_h : (long)cinfo->image_height;
    long right = g1 * interval * g.mcu_w < (long)cinfo->image_width ? g1 * interval * g.mcu_w : (long)cinfo->image_width;
    long kept_h = bottom - first * g.mcu_h, kept_w = right - g0 * interval * g.mcu_w;
    out[lay.sof + 5] = (unsigned char)(kept_h >> 8);
    out[lay.sof + 6] = (unsigned char)(kept_h & 0xFF);
    out[lay.sof + 7] = (unsigned char)(kept_w >> 8);
    out[lay.sof + 8] = (unsigned char)(kept_w & 0xFF);
    *stream_len = n;
    *row_shift = first * step;
    *col_shift = g0 * stepx;
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
    long row_shift = 0, col_shift = 0;
    if (fl_cut_stream(src, len, &cinfo, y0, x0, h, w, num, scratch, &cut_len, &row_shift, &col_shift)) {
        jpeg_abort_decompress(&cinfo); /* the same object reads the cut stream */
        jpeg_mem_src(&cinfo, scratch->stream, (unsigned long)cut_len);
        jpeg_read_header(&cinfo, TRUE);
        cinfo.out_color_space = JCS_RGB;
        cinfo.scale_num = (unsigned int)num;
        cinfo.scale_denom = 8;
        y0 -= row_shift;
        x0 -= col_shift;
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

/* MCUs per restart interval for an image of grid g: a divisor of the MCUs per row (so the intervals
 * tile each MCU row in equal column groups), the one nearest FL_GROUP_PIXELS image columns (the
 * larger on a tie), coarser while the index would not fit its segment. 0 if none fits. */
static long fl_pick_interval(const fl_grid *g) {
    long target = FL_GROUP_PIXELS / g->mcu_w > 0 ? FL_GROUP_PIXELS / g->mcu_w : 1, best = 0, best_bad = 0;
    for (long d = 1; d <= g->per_row; d++) {
        if (g->per_row % d != 0 || g->rows * (g->per_row / d) - 1 > FL_MAX_INDEX) continue;
        long bad = d >= target ? 1000 * d / target : 1000 * target / d; /* ratio to the target, x1000 */
        if (best == 0 || bad <= best_bad) best = d, best_bad = bad;
    }
    return best;
}

/* Re-encodes src losslessly (its DCT coefficients, quantisation tables and sampling copied;
 * Huffman tables optimised; progressive input written as baseline) with a restart marker after
 * every `interval` MCUs (0: fl_pick_interval's; it must divide the MCUs per row), APPn/COM markers
 * kept (an old restart index dropped), and the APP9 restart index (version 2) written after the
 * APPn segments that follow SOI. Returns 0 with out and out_len set (malloc), else -1 with a
 * message in msg. */
static int fl_transcode(const unsigned char *src, size_t len, long interval, unsigned char **out, size_t *out_len,
                        char *msg) {
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
    fl_grid g;
    fl_grid_of(&din, &g);
    if (interval == 0) interval = fl_pick_interval(&g);
    if (interval < 1 || interval > 65535 || g.per_row % interval != 0 || g.rows * (g.per_row / interval) - 1 > FL_MAX_INDEX) {
        snprintf(msg, JMSG_LENGTH_MAX, "no restart interval of %ld MCUs fits a %ldx%ld-MCU image", interval, g.rows,
                 g.per_row);
        jpeg_destroy_decompress(&din);
        return -1;
    }
    long intervals = g.rows * (g.per_row / interval);
    jvirt_barray_ptr *coefs = jpeg_read_coefficients(&din);
    jpeg_create_compress(&cout);
    made_out = 1;
    jpeg_mem_dest(&cout, &enc, &enc_len);
    jpeg_copy_critical_parameters(&din, &cout);
    cout.restart_interval = (unsigned int)interval;
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
    jpeg_destroy_compress(&cout);
    made_out = 0;
    jpeg_finish_decompress(&din);
    jpeg_destroy_decompress(&din);
    made_in = 0;

    fl_layout lay;
    long count = -1;
    offs = malloc(sizeof(unsigned long) * FL_MAX_INDEX);
    if (offs != NULL && fl_scan_layout(enc, enc_len, &lay)) count = fl_find_restarts(enc, enc_len, lay.entropy, offs);
    if (count != intervals - 1) {
        snprintf(msg, JMSG_LENGTH_MAX, "the re-encoded image has %ld restart markers, expected %ld", count,
                 intervals - 1);
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
    o[10] = 2; /* version */
    o[11] = 1; /* MCU rows per restart interval: one, cut into column groups */
    o[12] = (unsigned char)(interval >> 8), o[13] = (unsigned char)interval; /* MCUs per restart interval */
    for (long j = 0; j < count; j++) {
        unsigned char *q = o + 4 + FL_INDEX_HEAD + 4 * j;
        q[0] = (unsigned char)(offs[j] >> 24), q[1] = (unsigned char)(offs[j] >> 16);
        q[2] = (unsigned char)(offs[j] >> 8), q[3] = (unsigned char)offs[j];
    }
    memcpy(o + 2 + seg, enc + at, enc_len - at);
    free(offs);
    free(enc);
    return 0;
}

PyDoc_STRVAR(transcode_restart_doc,
             "transcode_restart(data, interval=0) -> bytes\n\n"
             "A JPEG re-encoded losslessly (same DCT coefficients: a decoder gives the same pixels) as a\n"
             "baseline JPEG with a restart marker after every `interval` MCUs (a divisor of the MCUs per\n"
             "row: each MCU row cut into equal column groups; 0: the divisor nearest 64 image columns) and\n"
             "the APP9 'FLRST' restart index, version 2 (formats/FORMAT.md); Huffman tables optimised,\n"
             "APPn/COM markers kept. Raises ValueError with libjpeg's message when the data is not a JPEG\n"
             "it can re-encode (corrupt data included), or when `interval` does not divide the MCU rows.\n"
             "Runs without the GIL.");

static PyObject *transcode_restart(PyObject *self, PyObject *args) {
    Py_buffer data;
    long interval = 0;
    if (!PyArg_ParseTuple(args, "y*|l", &data, &interval)) return NULL;
    unsigned char *out = NULL;
    size_t out_len = 0;
    char msg[JMSG_LENGTH_MAX];
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = fl_transcode((const unsigned char *)data.buf, (size_t)data.len, interval, &out, &out_len, msg);
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
             "marker expected, one per restart interval but the first); None otherwise (the decoder then\n"
             "reads the whole stream).");

static PyObject *restart_index(PyObject *self, PyObject *args) {
    Py_buffer data;
    if (!PyArg_ParseTuple(args, "y*", &data)) return NULL;
    const unsigned char *s = (const unsigned char *)data.buf;
    size_t len = (size_t)data.len;
    fl_layout lay;
    struct jpeg_decompress_struct cinfo;
    fl_error err;
    volatile int created = 0, sound = 0;
    fl_grid g;
    long interval = 0, intervals = 0;
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
        sound = fl_restart_grid(&cinfo, &lay, &g, &interval);
        if (sound) intervals = g.rows * (g.per_row / interval);
        sound = sound && fl_check_index(s, len, &lay, intervals);
    }
    if (created) jpeg_destroy_decompress(&cinfo);
    PyObject *result;
    if (!sound) {
        result = Py_NewRef(Py_None);
    } else {
        result = PyTuple_New(intervals - 1);
        for (long j = 0; result != NULL && j < intervals - 1; j++) {
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
