/* fastload.formats._ranges: copy a batch's item ranges out of one source buffer into one
 * destination buffer, with the GIL released during the copies.
 *
 *   gather(src, starts, lengths, itemsize, dst) -> None
 *
 * src: any buffer (read-only is fine); starts, lengths: C-contiguous int64 buffers of equal
 * length, in items of `itemsize` bytes; dst: a writable buffer of exactly sum(lengths) * itemsize
 * bytes. Range i is src[starts[i] * itemsize : (starts[i] + lengths[i]) * itemsize]; it lands
 * right after range i - 1 in dst. Every range is bounds-checked before anything is copied:
 * IndexError names the first bad position; ValueError for a size mismatch.
 *
 * The gather reads ahead: while a range is copied, the first cache lines of the next ones are
 * prefetched (a batch's ranges lie at random places; the hardware prefetcher only follows a range
 * once it has started, so each range would otherwise begin with a full memory latency).
 *
 *   split(values, offsets, utf8) -> list
 *
 * values: a byte buffer; offsets: a C-contiguous int64 buffer, non-decreasing, within values.
 * Item i is values[offsets[i]:offsets[i + 1]] as bytes (utf8 false) or str decoded as UTF-8
 * (utf8 true; UnicodeDecodeError for invalid UTF-8). ValueError for bad offsets.
 *
 *   offsets_match(offsets, lengths, total) -> bool
 *
 * offsets: a C-contiguous 8-byte integer buffer of n + 1 entries, read as unsigned; lengths: None
 * or a C-contiguous int64 buffer of n entries. True when offsets run from 0 to `total`, never
 * decrease, and (with lengths) offsets[i + 1] - offsets[i] == lengths[i] for every i; False
 * otherwise, or when the sizes differ (a caller finds out what is wrong itself).
 *
 *   spans(buffers, addresses, lengths) -> None
 *
 * buffers: a sequence of buffer objects (e.g. memoryviews into a mapped file); addresses, lengths:
 * writable C-contiguous int64 buffers of the same length, filled with each buffer's start address
 * and size in bytes.
 *
 *   take_rows(sources, which, rows, rowbytes, dst, positions=None) -> None
 *
 * Rows from several sources: dst[i] = sources[which[i]][rows[i]] for rows of `rowbytes` bytes, or
 * with positions dst[positions[i]] = ... (rows put in chosen places). sources: a sequence of
 * C-contiguous buffers holding whole rows, None where no row is taken; which: None (every row from
 * sources[0]) or a C-contiguous int64 buffer; rows (and positions): C-contiguous int64 buffers of as
 * many entries; dst: a writable C-contiguous buffer of whole rows, exactly len(rows) of them without
 * positions. The GIL is released and the next rows' first cache lines are prefetched. Every index is
 * bounds-checked before anything is copied (IndexError).
 *
 *   take_sharded(sources, starts, indices, rowbytes, dst, ready=None, offsets=None, shift=0, record=None) -> int
 *
 * Rows of a dataset split into shards, by dataset index: shard k holds indices [starts[k],
 * starts[k + 1]) as the rows of sources[k]; dst[i] = sources[k][indices[i] - starts[k]] for the k whose
 * range holds indices[i]. sources: a sequence of S C-contiguous buffers of whole rows, None for a shard
 * not to be read now; starts: a C-contiguous int64 buffer of S + 1 non-decreasing entries; indices: a
 * C-contiguous int64 buffer; dst: a writable C-contiguous buffer of exactly len(indices) rows. With
 * ready (a sequence of S), a row of shard k is read only when ready[k] is None or every block of
 * 2**shift bytes its bytes [offsets[k] + row * rowbytes, + rowbytes) touch in its file has a nonzero
 * byte in ready[k] (a C-contiguous byte buffer, one per block: blocks verified so far); offsets: a
 * C-contiguous int64 buffer of S entries. record (with ready): a sequence of S, each None or a writable
 * byte buffer like ready[k], in which the blocks of the rows read are set to 1 (a ledger of blocks
 * verified, kept beside the ready record it takes them from). Returns -1 once every row was copied (GIL
 * released, the next rows prefetched). Returns the position of the first index that cannot be read here, with nothing
 * copied: outside [0, starts[S]), in a shard whose source is None, past the rows its source holds, or
 * over a block not ready (the caller reads that batch another way, which waits, verifies and reports
 * errors).
 *
 *   xxh3_blocks(buf, ids, shift, end, out) -> None
 *
 * buf: any buffer; ids: a C-contiguous int64 buffer of block numbers; out: a writable C-contiguous
 * 8-byte buffer of as many entries. out[i] = XXH3-64 (seed 0, as `xxhash.xxh3_64_intdigest`) of bytes
 * [ids[i] << shift, min((ids[i] + 1) << shift, end)) of buf, hashed with the GIL released (xxHash from
 * formats/vendor, BSD 2-Clause; on x86 its dispatcher picks SSE2, AVX2 or AVX-512 at run time). ValueError
 * for a block outside [0, end) or end > len(buf).
 *
 *   write_blocks(fd, offset, piece, shift, end, table, published, carry) -> (done, bad, write_s, hash_s)
 *
 * One received piece of a shard verified by block (format version 2), in one call with the GIL
 * released: piece (any buffer) holds the file's bytes [offset, offset + len(piece)), which must lie
 * within [0, end) (end: where the checksummed sections end); blocks are 2**shift bytes, the last one
 * ends at `end`. table: the shard's block checksums (C-contiguous 8-byte buffer, one per block);
 * published: one byte per block (a bool array), nonzero for blocks already verified, which are
 * neither written nor hashed again. The piece's bytes of unpublished blocks are written to fd at
 * their offsets (pwrite, OSError on failure); then each unpublished block wholly inside the piece
 * is hashed (XXH3-64) and compared with its table entry, in block order, stopping at the first
 * mismatch. done: the blocks that matched (a list of ints, in order); bad: the first block that did
 * not, or -1; write_s, hash_s: seconds spent writing and hashing. Blocks the piece covers only in
 * part are written and left to the caller (their other bytes arrive in other pieces), but for
 * carry: None, or the bytes [offset - len(carry), offset) already written (the start of a block, from
 * the previous piece of the same stream), which the piece must complete: that block is hashed from
 * carry and the piece's first bytes, checked first.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#include <errno.h>
#include <time.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY /* XXH3_state_t on the stack (write_blocks: a block across two pieces) */
#include "vendor/xxhash.h"
#if defined(FASTLOAD_XXH_X86_DISPATCH)
#include "vendor/xxh_x86dispatch.h"
#define fastload_xxh3 XXH3_64bits_dispatch /* the widest vector unit this CPU has, chosen at run time */
#define fastload_xxh3_update XXH3_64bits_update_dispatch
#else
#define fastload_xxh3 XXH3_64bits
#define fastload_xxh3_update XXH3_64bits_update
#endif

static int get_i64_flags(PyObject *obj, Py_buffer *view, const char *what, int flags) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | flags) < 0) return -1;
    if (view->itemsize != 8 || view->format == NULL || (strcmp(view->format, "l") && strcmp(view->format, "q") &&
                                                        strcmp(view->format, "<q") && strcmp(view->format, "=q") &&
                                                        strcmp(view->format, "<l") && strcmp(view->format, "=l"))) {
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 buffer", what);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

static int get_i64(PyObject *obj, Py_buffer *view, const char *what) { return get_i64_flags(obj, view, what, 0); }

/* How far the gather reads ahead: the ranges `PREFETCH_AHEAD` places on, their first `PREFETCH_LINES`
 * 64-byte lines (measured on the mixed records of `python -m bench.mixed_records`). */
#define PREFETCH_AHEAD 2
#define PREFETCH_LINES 4

static inline void prefetch_start(const char *p, size_t nbytes) {
    for (size_t k = 0; k < PREFETCH_LINES && k * 64 < nbytes; k++) __builtin_prefetch(p + k * 64);
}

/* Rows of `unit` bytes, checked by the caller: out[places ? places[i] : i] = base[which ? which[i] : 0] + rows[i]
 * rows in, the next rows' first lines prefetched. Needs no GIL (the callers release it). */
static void copy_rows(char *out, const char *const *base, const int64_t *which, const int64_t *rows,
                      const int64_t *places, Py_ssize_t n, size_t unit) {
#define ROW_AT(i) (base[which ? which[i] : 0] + (size_t)rows[i] * unit)
    for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_start(ROW_AT(i), unit);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + PREFETCH_AHEAD < n) prefetch_start(ROW_AT(i + PREFETCH_AHEAD), unit);
        memcpy(out + (size_t)(places ? places[i] : i) * unit, ROW_AT(i), unit);
    }
#undef ROW_AT
}

static PyObject *gather(PyObject *self, PyObject *args) {
    PyObject *src_obj, *starts_obj, *lengths_obj, *dst_obj;
    Py_ssize_t itemsize;
    PyObject *result = NULL;
    if (!PyArg_ParseTuple(args, "OOOnO", &src_obj, &starts_obj, &lengths_obj, &itemsize, &dst_obj)) return NULL;
    if (itemsize <= 0) {
        PyErr_SetString(PyExc_ValueError, "itemsize must be positive");
        return NULL;
    }
    Py_buffer src, starts, lengths, dst;
    if (PyObject_GetBuffer(src_obj, &src, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (get_i64(starts_obj, &starts, "starts") < 0) goto fail_src;
    if (get_i64(lengths_obj, &lengths, "lengths") < 0) goto fail_starts;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail_lengths;

    Py_ssize_t n = starts.len / 8;
    if (lengths.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "starts and lengths differ in length");
        goto done;
    }
    const int64_t *s = (const int64_t *)starts.buf, *l = (const int64_t *)lengths.buf;
    int64_t src_items = (int64_t)(src.len / itemsize), total = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (s[i] < 0 || l[i] < 0 || s[i] > src_items || l[i] > src_items - s[i]) {
            PyErr_Format(PyExc_IndexError, "range %zd ([%lld, +%lld) items) lies outside the source of %lld items", i,
                         (long long)s[i], (long long)l[i], (long long)src_items);
            goto done;
        }
        total += l[i];
    }
    if (total > (int64_t)(PY_SSIZE_T_MAX / itemsize) || (Py_ssize_t)total * itemsize != dst.len) {
        PyErr_Format(PyExc_ValueError, "destination holds %zd bytes, the ranges %lld", dst.len,
                     (long long)total * (long long)itemsize);
        goto done;
    }
    {
        const char *in = (const char *)src.buf;
        char *out = (char *)dst.buf;
        size_t unit = (size_t)itemsize;
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n && i < PREFETCH_AHEAD; i++) prefetch_start(in + (size_t)s[i] * unit, (size_t)l[i] * unit);
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t j = i + PREFETCH_AHEAD;
            if (j < n) prefetch_start(in + (size_t)s[j] * unit, (size_t)l[j] * unit);
            size_t nb = (size_t)l[i] * unit;
            memcpy(out, in + (size_t)s[i] * unit, nb);
            out += nb;
        }
        Py_END_ALLOW_THREADS
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&dst);
fail_lengths:
    PyBuffer_Release(&lengths);
fail_starts:
    PyBuffer_Release(&starts);
fail_src:
    PyBuffer_Release(&src);
    return result;
}

static PyObject *split(PyObject *self, PyObject *args) {
    PyObject *values_obj, *offsets_obj;
    int utf8;
    if (!PyArg_ParseTuple(args, "OOp", &values_obj, &offsets_obj, &utf8)) return NULL;
    Py_buffer values, offsets;
    PyObject *result = NULL;
    if (PyObject_GetBuffer(values_obj, &values, PyBUF_C_CONTIGUOUS) < 0) return NULL;
    if (get_i64(offsets_obj, &offsets, "offsets") < 0) goto fail_values;
    Py_ssize_t n = offsets.len / 8 - 1;
    const int64_t *o = (const int64_t *)offsets.buf;
    if (n < 0) {
        PyErr_SetString(PyExc_ValueError, "offsets must not be empty");
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (o[i] < 0 || o[i + 1] < o[i] || o[i + 1] > (int64_t)values.len) {
            PyErr_Format(PyExc_ValueError, "offsets of item %zd ([%lld, %lld)) lie outside the %zd bytes of values", i,
                         (long long)o[i], (long long)o[i + 1], values.len);
            goto done;
        }
    }
    result = PyList_New(n);
    if (result == NULL) goto done;
    const char *base = (const char *)values.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t len = (Py_ssize_t)(o[i + 1] - o[i]);
        PyObject *item = utf8 ? PyUnicode_DecodeUTF8(base + o[i], len, "strict")
                              : PyBytes_FromStringAndSize(base + o[i], len);
        if (item == NULL) {
            Py_CLEAR(result);
            goto done;
        }
        PyList_SET_ITEM(result, i, item);
    }
done:
    PyBuffer_Release(&offsets);
fail_values:
    PyBuffer_Release(&values);
    return result;
}

static PyObject *offsets_match(PyObject *self, PyObject *args) {
    PyObject *offsets_obj, *lengths_obj;
    long long total;
    if (!PyArg_ParseTuple(args, "OOL", &offsets_obj, &lengths_obj, &total)) return NULL;
    Py_buffer offsets, lengths;
    if (get_i64(offsets_obj, &offsets, "offsets") < 0) return NULL;
    int has_lengths = lengths_obj != Py_None, match = 1;
    if (has_lengths && get_i64(lengths_obj, &lengths, "lengths") < 0) {
        PyBuffer_Release(&offsets);
        return NULL;
    }
    Py_ssize_t n = offsets.len / 8 - 1;
    const uint64_t *o = (const uint64_t *)offsets.buf;
    const int64_t *l = has_lengths ? (const int64_t *)lengths.buf : NULL;
    if (n < 0 || (has_lengths && lengths.len / 8 != n) || total < 0 || o[0] != 0 || o[n] != (uint64_t)total) {
        match = 0;
    } else {
        for (Py_ssize_t i = 0; i < n; i++) {
            if (o[i + 1] < o[i] || (l != NULL && (l[i] < 0 || o[i + 1] - o[i] != (uint64_t)l[i]))) {
                match = 0;
                break;
            }
        }
    }
    if (has_lengths) PyBuffer_Release(&lengths);
    PyBuffer_Release(&offsets);
    return PyBool_FromLong(match);
}

static PyObject *spans(PyObject *self, PyObject *args) {
    PyObject *seq_obj, *addr_obj, *len_obj, *result = NULL;
    if (!PyArg_ParseTuple(args, "OOO", &seq_obj, &addr_obj, &len_obj)) return NULL;
    PyObject *seq = PySequence_Fast(seq_obj, "buffers must be a sequence");
    if (seq == NULL) return NULL;
    Py_buffer addr, lens;
    if (get_i64_flags(addr_obj, &addr, "addresses", PyBUF_WRITABLE) < 0) goto fail_seq;
    if (get_i64_flags(len_obj, &lens, "lengths", PyBUF_WRITABLE) < 0) goto fail_addr;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (addr.len / 8 != n || lens.len / 8 != n) {
        PyErr_SetString(PyExc_ValueError, "addresses and lengths must hold one int64 per buffer");
        goto done;
    }
    int64_t *a = (int64_t *)addr.buf, *l = (int64_t *)lens.buf;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_buffer b;
        if (PyObject_GetBuffer(items[i], &b, PyBUF_SIMPLE) < 0) goto done;
        a[i] = (int64_t)(intptr_t)b.buf;
        l[i] = (int64_t)b.len;
        PyBuffer_Release(&b);
    }
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&lens);
fail_addr:
    PyBuffer_Release(&addr);
fail_seq:
    Py_DECREF(seq);
    return result;
}

static PyObject *xxh3_blocks(PyObject *self, PyObject *args) {
    PyObject *buf_obj, *ids_obj, *out_obj, *result = NULL;
    int shift;
    long long end;
    if (!PyArg_ParseTuple(args, "OOiLO", &buf_obj, &ids_obj, &shift, &end, &out_obj)) return NULL;
    if (shift < 6 || shift > 40) {
        PyErr_Format(PyExc_ValueError, "block shift %d is out of range", shift);
        return NULL;
    }
    Py_buffer buf, ids, out;
    if (PyObject_GetBuffer(buf_obj, &buf, PyBUF_SIMPLE) < 0) return NULL;
    if (get_i64(ids_obj, &ids, "ids") < 0) goto fail_buf;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto fail_ids;
    Py_ssize_t n = ids.len / 8;
    const int64_t *id = (const int64_t *)ids.buf;
    if (out.len != ids.len) {
        PyErr_SetString(PyExc_ValueError, "out must hold one 8-byte entry per id");
        goto done;
    }
    if (end < 0 || end > (long long)buf.len) {
        PyErr_Format(PyExc_ValueError, "end %lld is outside the buffer of %zd bytes", end, buf.len);
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (id[i] < 0 || id[i] >= ((end + (1LL << shift) - 1) >> shift)) {
            PyErr_Format(PyExc_ValueError, "block %lld is outside the %lld bytes hashed", (long long)id[i], end);
            goto done;
        }
    }
    const char *p = (const char *)buf.buf;
    uint64_t *o = (uint64_t *)out.buf;
    const long long size = 1LL << shift;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t i = 0; i < n; i++) {
        long long a = (long long)id[i] << shift;
        long long len = end - a < size ? end - a : size;
        o[i] = (uint64_t)fastload_xxh3(p + a, (size_t)len);
    }
    Py_END_ALLOW_THREADS
    result = Py_None;
    Py_INCREF(result);
done:
    PyBuffer_Release(&out);
fail_ids:
    PyBuffer_Release(&ids);
fail_buf:
    PyBuffer_Release(&buf);
    return result;
}

static double seconds_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* pwrite all of [p, p + n) at off; 0, or -1 with errno set */
static int pwrite_all(int fd, const char *p, size_t n, long long off) {
    while (n) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        if (w == 0) {
            errno = EIO;
            return -1;
        }
        p += w;
        n -= (size_t)w;
        off += w;
    }
    return 0;
}

static PyObject *write_blocks(PyObject *self, PyObject *args) {
    int fd, shift;
    long long offset, end;
    PyObject *piece_obj, *table_obj, *published_obj, *carry_obj = Py_None, *result = NULL;
    if (!PyArg_ParseTuple(args, "iLOiLOO|O", &fd, &offset, &piece_obj, &shift, &end, &table_obj, &published_obj,
                          &carry_obj))
        return NULL;
    if (shift < 6 || shift > 40) {
        PyErr_Format(PyExc_ValueError, "block shift %d is out of range", shift);
        return NULL;
    }
    Py_buffer piece, table, published, carry = {0};
    if (PyObject_GetBuffer(piece_obj, &piece, PyBUF_SIMPLE) < 0) return NULL;
    if (PyObject_GetBuffer(table_obj, &table, PyBUF_C_CONTIGUOUS) < 0) goto fail_piece;
    if (PyObject_GetBuffer(published_obj, &published, PyBUF_C_CONTIGUOUS) < 0) goto fail_table;
    if (carry_obj != Py_None && PyObject_GetBuffer(carry_obj, &carry, PyBUF_SIMPLE) < 0) goto fail_published;
    const long long size = 1LL << shift;
    const long long count = (end + size - 1) >> shift;
    const long long stop = offset + (long long)piece.len;
    const long long carry_from = offset - (long long)carry.len; /* where the carried block starts */
    if (offset < 0 || end < 0 || stop > end) {
        PyErr_Format(PyExc_ValueError, "bytes [%lld, %lld) lie outside the sections' [0, %lld)", offset, stop, end);
        goto done;
    }
    if (carry.len && (carry_from < 0 || carry_from & (size - 1) || carry.len >= size ||
                      stop < (carry_from + size < end ? carry_from + size : end))) {
        PyErr_Format(PyExc_ValueError, "carry [%lld, %lld) is not the start of a block that bytes up to %lld complete",
                     carry_from, offset, stop);
        goto done;
    }
    if (table.len != count * 8 || published.len != count) {
        PyErr_Format(PyExc_ValueError, "%lld blocks of 2**%d bytes end at %lld: table holds %zd bytes, published %zd",
                     count, shift, end, table.len, published.len);
        goto done;
    }
    if (!piece.len) {
        result = Py_BuildValue("([]idd)", -1, 0.0, 0.0);
        goto done;
    }
    {
        const char *p = (const char *)piece.buf;
        const uint64_t *sums = (const uint64_t *)table.buf;
        const unsigned char *pub = (const unsigned char *)published.buf;
        const long long first = offset >> shift, last = (stop - 1) >> shift;
        /* blocks wholly inside the piece: from the first block starting at or after offset to the last
           ending at or before stop (the sections' last block ends at `end`) */
        const long long whole_lo = (offset + size - 1) >> shift;
        const long long whole_hi = stop == end ? last + 1 : stop >> shift;
        long long bad = -1, ndone = 0;
        int err = 0;
        double t0, t1, t2;
        long long *done_ids = NULL;
        if (whole_hi > whole_lo || carry.len) {
            done_ids = (long long *)PyMem_Malloc(sizeof(long long) * (size_t)(whole_hi - whole_lo + 1));
            if (!done_ids) {
                PyErr_NoMemory();
                goto done;
            }
        }
        Py_BEGIN_ALLOW_THREADS
        t0 = seconds_now();
        /* write runs of unpublished blocks, each in one pwrite */
        long long j = first;
        while (j <= last && !err) {
            if (pub[j]) {
                j++;
                continue;
            }
            long long k = j;
            while (k + 1 <= last && !pub[k + 1]) k++;
            long long lo = j << shift > offset ? j << shift : offset;
            long long hi = (k + 1) << shift < stop ? (k + 1) << shift : stop;
            if (pwrite_all(fd, p + (lo - offset), (size_t)(hi - lo), lo) < 0) err = errno;
            j = k + 1;
        }
        t1 = seconds_now();
        if (carry.len && !err && !pub[carry_from >> shift]) { /* the block begun in the previous piece */
            const long long c = carry_from >> shift;
            const long long rest = (carry_from + size < end ? carry_from + size : end) - offset;
            XXH3_state_t state;
            XXH3_64bits_reset(&state);
            fastload_xxh3_update(&state, carry.buf, (size_t)carry.len);
            fastload_xxh3_update(&state, p, (size_t)rest);
            if ((uint64_t)XXH3_64bits_digest(&state) != sums[c])
                bad = c;
            else
                done_ids[ndone++] = c;
        }
        for (long long b = whole_lo; b < whole_hi && !err && bad < 0; b++) {
            if (pub[b]) continue;
            long long a = b << shift;
            long long len = end - a < size ? end - a : size;
            if ((uint64_t)fastload_xxh3(p + (a - offset), (size_t)len) != sums[b]) {
                bad = b;
                break;
            }
            done_ids[ndone++] = b;
        }
        t2 = seconds_now();
        Py_END_ALLOW_THREADS
        if (err) {
            PyMem_Free(done_ids);
            errno = err;
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
        PyObject *done_list = PyList_New((Py_ssize_t)ndone);
        if (!done_list) {
            PyMem_Free(done_ids);
            goto done;
        }
        for (long long i = 0; i < ndone; i++) {
            PyObject *v = PyLong_FromLongLong(done_ids[i]);
            if (!v) {
                Py_DECREF(done_list);
                PyMem_Free(done_ids);
                goto done;
            }
            PyList_SET_ITEM(done_list, (Py_ssize_t)i, v);
        }
        PyMem_Free(done_ids);
        result = Py_BuildValue("(NLdd)", done_list, bad, t1 - t0, t2 - t1);
    }
done:
    if (carry.obj) PyBuffer_Release(&carry);
fail_published:
    PyBuffer_Release(&published);
fail_table:
    PyBuffer_Release(&table);
fail_piece:
    PyBuffer_Release(&piece);
    return result;
}

static PyObject *take_rows(PyObject *self, PyObject *args) {
    PyObject *sources_obj, *which_obj, *rows_obj, *dst_obj, *pos_obj = Py_None, *seq, *result = NULL;
    Py_ssize_t rowbytes;
    if (!PyArg_ParseTuple(args, "OOOnO|O", &sources_obj, &which_obj, &rows_obj, &rowbytes, &dst_obj, &pos_obj))
        return NULL;
    if (rowbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "rowbytes must be positive");
        return NULL;
    }
    seq = PySequence_Fast(sources_obj, "sources must be a sequence");
    if (seq == NULL) return NULL;
    const Py_ssize_t ns = PySequence_Fast_GET_SIZE(seq);
    Py_buffer *views = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, sizeof(Py_buffer));
    const char **base = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, sizeof(char *));
    int64_t *count = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, sizeof(int64_t));
    char *got = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, 1); /* 1 where views[j] holds a buffer */
    Py_ssize_t held = 0;
    Py_buffer which = {0}, rows = {0}, dst = {0}, pos = {0};
    int have_which = 0, have_rows = 0, have_dst = 0, have_pos = 0;
    if (views == NULL || base == NULL || count == NULL || got == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (; held < ns; held++) {
        PyObject *item = PySequence_Fast_GET_ITEM(seq, held);
        if (item == Py_None) continue;
        if (PyObject_GetBuffer(item, &views[held], PyBUF_C_CONTIGUOUS) < 0) goto done;
        got[held] = 1;
        base[held] = (const char *)views[held].buf;
        count[held] = (int64_t)(views[held].len / rowbytes);
    }
    if (which_obj != Py_None) {
        if (get_i64(which_obj, &which, "which") < 0) goto done;
        have_which = 1;
    }
    if (get_i64(rows_obj, &rows, "rows") < 0) goto done;
    have_rows = 1;
    if (pos_obj != Py_None) {
        if (get_i64(pos_obj, &pos, "positions") < 0) goto done;
        have_pos = 1;
    }
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    have_dst = 1;
    {
        const Py_ssize_t n = rows.len / 8;
        const int64_t *r = (const int64_t *)rows.buf, *w = have_which ? (const int64_t *)which.buf : NULL;
        const int64_t *q = have_pos ? (const int64_t *)pos.buf : NULL, dst_rows = (int64_t)(dst.len / rowbytes);
        if ((have_which && which.len != rows.len) || (have_pos && pos.len != rows.len)) {
            PyErr_SetString(PyExc_ValueError, "which, rows and positions differ in length");
            goto done;
        }
        if (have_pos ? dst.len % rowbytes != 0 : dst.len != n * rowbytes) {
            PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, not %s %zd rows of %zd", dst.len,
                         have_pos ? "whole" : "exactly", n, rowbytes);
            goto done;
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            const int64_t s = w ? w[i] : 0;
            if (s < 0 || s >= ns || !got[s] || r[i] < 0 || r[i] >= count[s]) {
                PyErr_Format(PyExc_IndexError, "row %lld of source %lld: no such row (%lld sources)", (long long)r[i],
                             (long long)s, (long long)ns);
                goto done;
            }
            if (q && (q[i] < 0 || q[i] >= dst_rows)) {
                PyErr_Format(PyExc_IndexError, "place %lld: no such row in dst (%lld rows)", (long long)q[i],
                             (long long)dst_rows);
                goto done;
            }
        }
        Py_BEGIN_ALLOW_THREADS
        copy_rows((char *)dst.buf, base, w, r, q, n, (size_t)rowbytes);
        Py_END_ALLOW_THREADS
        result = Py_None;
        Py_INCREF(result);
    }
done:
    if (have_pos) PyBuffer_Release(&pos);
    if (have_dst) PyBuffer_Release(&dst);
    if (have_rows) PyBuffer_Release(&rows);
    if (have_which) PyBuffer_Release(&which);
    for (Py_ssize_t j = 0; j < held; j++)
        if (got[j]) PyBuffer_Release(&views[j]);
    PyMem_Free(got);
    PyMem_Free(views);
    PyMem_Free(base);
    PyMem_Free(count);
    Py_DECREF(seq);
    return result;
}

/* The shard holding dataset index `i`: the k with starts[k] <= i < starts[k + 1], trying `hint` first. */
static inline Py_ssize_t shard_of(const int64_t *starts, Py_ssize_t ns, int64_t i, Py_ssize_t hint) {
    if (hint >= 0 && hint < ns && starts[hint] <= i && i < starts[hint + 1]) return hint;
    Py_ssize_t lo = 0, hi = ns; /* starts[lo] <= i < starts[hi] */
    while (hi - lo > 1) {
        Py_ssize_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* One buffer (or None) per shard, each taken on first use and released by `shard_buffers_close`. */
typedef struct {
    PyObject *seq;     /* the sequence, through PySequence_Fast */
    Py_buffer *views;  /* views[k] holds shard k's buffer where state[k] == 1 */
    char *state;       /* 0 not looked at yet, 1 a buffer, 2 None */
    int flags;         /* PyObject_GetBuffer flags */
} shard_buffers;

/* Open `obj`, a sequence of buffers or None, of `expected` entries unless that is negative (`what` names it
 * in errors): its length, or -1 with an exception set. */
static Py_ssize_t shard_buffers_open(shard_buffers *b, PyObject *obj, Py_ssize_t expected, const char *what,
                                     int flags) {
    b->flags = flags;
    if (PyList_Check(obj) || PyTuple_Check(obj)) {
        b->seq = PySequence_Fast(obj, ""); /* the list or tuple itself: no message needed (nor formatted per call) */
    } else {
        char message[80];
        snprintf(message, sizeof message, "%s must be a sequence", what);
        b->seq = PySequence_Fast(obj, message);
    }
    if (b->seq == NULL) return -1;
    const Py_ssize_t ns = PySequence_Fast_GET_SIZE(b->seq);
    if (expected >= 0 && ns != expected) {
        PyErr_Format(PyExc_ValueError, "%s and sources differ in length", what);
        return -1;
    }
    b->views = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, sizeof(Py_buffer));
    b->state = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, 1);
    if (b->views == NULL || b->state == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return ns;
}

/* Shard k's entry: 1 (its buffer is b->views[k]), 2 (None), or -1 with an exception set. */
static int shard_buffer(shard_buffers *b, Py_ssize_t k) {
    if (!b->state[k]) {
        PyObject *item = PySequence_Fast_GET_ITEM(b->seq, k);
        if (item == Py_None)
            b->state[k] = 2;
        else if (PyObject_GetBuffer(item, &b->views[k], b->flags) < 0)
            return -1;
        else
            b->state[k] = 1;
    }
    return b->state[k];
}

static void shard_buffers_close(shard_buffers *b, Py_ssize_t ns) {
    if (b->state != NULL)
        for (Py_ssize_t k = 0; k < ns; k++)
            if (b->state[k] == 1) PyBuffer_Release(&b->views[k]);
    PyMem_Free(b->state);
    PyMem_Free(b->views);
    Py_XDECREF(b->seq);
}

static PyObject *take_sharded(PyObject *self, PyObject *args) {
    PyObject *sources_obj, *starts_obj, *indices_obj, *dst_obj, *ready_obj = Py_None, *offsets_obj = Py_None;
    PyObject *record_obj = Py_None, *result = NULL;
    Py_ssize_t rowbytes;
    int shift = 0;
    if (!PyArg_ParseTuple(args, "OOOnO|OOiO", &sources_obj, &starts_obj, &indices_obj, &rowbytes, &dst_obj, &ready_obj,
                          &offsets_obj, &shift, &record_obj))
        return NULL;
    if (rowbytes <= 0) {
        PyErr_SetString(PyExc_ValueError, "rowbytes must be positive");
        return NULL;
    }
    if (shift < 0 || shift > 40) {
        PyErr_SetString(PyExc_ValueError, "shift must be in [0, 40]");
        return NULL;
    }
    shard_buffers sources = {0}, ready = {0}, record = {0};
    const int checked = ready_obj != Py_None, recorded = checked && record_obj != Py_None;
    Py_buffer starts = {0}, indices = {0}, dst = {0}, offsets = {0};
    int have_starts = 0, have_indices = 0, have_dst = 0, have_offsets = 0;
    int64_t *which = NULL;    /* each row's shard, then (which + n) its row in that shard */
    const char **base = NULL; /* each shard's rows, once its buffer is taken */
    const Py_ssize_t ns = shard_buffers_open(&sources, sources_obj, -1, "sources", PyBUF_C_CONTIGUOUS);
    if (ns < 0) {
        shard_buffers_close(&sources, 0);
        return NULL;
    }
    if (checked) {
        if (shard_buffers_open(&ready, ready_obj, ns, "ready", PyBUF_C_CONTIGUOUS) < 0) goto done;
        if (get_i64(offsets_obj, &offsets, "offsets") < 0) goto done;
        have_offsets = 1;
        if (offsets.len / 8 != ns) {
            PyErr_SetString(PyExc_ValueError, "offsets and sources differ in length");
            goto done;
        }
    }
    if (recorded && shard_buffers_open(&record, record_obj, ns, "record", PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
        goto done;
    if (get_i64(starts_obj, &starts, "starts") < 0) goto done;
    have_starts = 1;
    if (get_i64(indices_obj, &indices, "indices") < 0) goto done;
    have_indices = 1;
    if (PyObject_GetBuffer(dst_obj, &dst, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0) goto done;
    have_dst = 1;
    if (starts.len / 8 != ns + 1) {
        PyErr_Format(PyExc_ValueError, "starts holds %zd entries, not one more than the %zd sources", starts.len / 8, ns);
        goto done;
    }
    const Py_ssize_t n = indices.len / 8;
    if (dst.len != n * rowbytes) {
        PyErr_Format(PyExc_ValueError, "dst holds %zd bytes, not exactly %zd rows of %zd", dst.len, n, rowbytes);
        goto done;
    }
    which = PyMem_Malloc((n > 0 ? 2 * (size_t)n : 1) * sizeof(int64_t));
    base = PyMem_Calloc(ns > 0 ? (size_t)ns : 1, sizeof(char *));
    if (which == NULL || base == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    {
        const int64_t *st = (const int64_t *)starts.buf, *idx = (const int64_t *)indices.buf;
        const int64_t *off = checked ? (const int64_t *)offsets.buf : NULL;
        for (Py_ssize_t k = 0; k < ns; k++) {
            if (st[k] > st[k + 1]) {
                PyErr_Format(PyExc_ValueError, "starts decrease at shard %zd", k);
                goto done;
            }
        }
        const int64_t total = ns > 0 ? st[ns] : 0;
        Py_ssize_t hint = 0;
        for (Py_ssize_t i = 0; i < n; i++) { /* every row checked (and its buffers taken) before any copy */
            if (ns == 0 || idx[i] < st[0] || idx[i] >= total) {
                result = PyLong_FromSsize_t(i);
                goto done;
            }
            const Py_ssize_t k = hint = shard_of(st, ns, idx[i], hint);
            const int64_t row = idx[i] - st[k];
            const int has = shard_buffer(&sources, k);
            if (has < 0) goto done;
            if (has == 2 || row >= (int64_t)(sources.views[k].len / rowbytes)) {
                result = PyLong_FromSsize_t(i);
                goto done;
            }
            const int gate = checked ? shard_buffer(&ready, k) : 2;
            if (gate < 0 || (recorded && gate == 1 && shard_buffer(&record, k) < 0)) goto done;
            if (gate == 1) {
                const int64_t lo = off[k] + row * rowbytes, last = (lo + rowbytes - 1) >> shift;
                const unsigned char *have = (const unsigned char *)ready.views[k].buf;
                int ok = off[k] >= 0 && last < (int64_t)ready.views[k].len;
                for (int64_t b = lo >> shift; ok && b <= last; b++) ok = have[b] != 0;
                if (!ok) {
                    result = PyLong_FromSsize_t(i);
                    goto done;
                }
            }
            base[k] = (const char *)sources.views[k].buf;
            which[i] = k;
            which[n + i] = row;
        }
        for (Py_ssize_t i = 0; recorded && i < n; i++) { /* every row is readable: record the blocks read from `ready` */
            const Py_ssize_t k = (Py_ssize_t)which[i];
            if (ready.state[k] != 1 || record.state[k] != 1) continue;
            const int64_t lo = off[k] + which[n + i] * rowbytes;
            unsigned char *mark = (unsigned char *)record.views[k].buf;
            for (int64_t b = lo >> shift; b <= (lo + rowbytes - 1) >> shift && b < (int64_t)record.views[k].len; b++)
                mark[b] = 1;
        }
        Py_BEGIN_ALLOW_THREADS
        copy_rows((char *)dst.buf, base, which, which + n, NULL, n, (size_t)rowbytes);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(-1);
    }
done:
    shard_buffers_close(&record, ns);
    shard_buffers_close(&ready, ns);
    shard_buffers_close(&sources, ns);
    PyMem_Free(base);
    PyMem_Free(which);
    if (have_offsets) PyBuffer_Release(&offsets);
    if (have_dst) PyBuffer_Release(&dst);
    if (have_indices) PyBuffer_Release(&indices);
    if (have_starts) PyBuffer_Release(&starts);
    return result;
}

/* missing_blocks(lo, hi, shift, bits, out): the blocks of 2**shift bytes that the byte ranges [lo[i], hi[i])
 * touch (empty ranges touch none) whose byte in `bits` is 0, each once and ascending, written to `out`
 * (int64, at least len(bits) long); returns how many. IndexError for a range outside the len(bits) blocks. */
static PyObject *missing_blocks(PyObject *self, PyObject *args) {
    PyObject *lo_obj, *hi_obj, *bits_obj, *out_obj, *result = NULL;
    int shift;
    if (!PyArg_ParseTuple(args, "OOiOO", &lo_obj, &hi_obj, &shift, &bits_obj, &out_obj)) return NULL;
    if (shift < 0 || shift > 40) {
        PyErr_SetString(PyExc_ValueError, "shift must be in [0, 40]");
        return NULL;
    }
    Py_buffer lo, hi, bits, out;
    if (get_i64(lo_obj, &lo, "lo") < 0) return NULL;
    if (get_i64(hi_obj, &hi, "hi") < 0) goto fail_lo;
    if (PyObject_GetBuffer(bits_obj, &bits, PyBUF_C_CONTIGUOUS) < 0) goto fail_hi;
    if (get_i64_flags(out_obj, &out, "out", PyBUF_WRITABLE) < 0) goto fail_bits;
    {
        const Py_ssize_t n = lo.len / 8, nblocks = bits.len;
        const int64_t *a = (const int64_t *)lo.buf, *b = (const int64_t *)hi.buf;
        const unsigned char *have = (const unsigned char *)bits.buf;
        int64_t *dst = (int64_t *)out.buf;
        unsigned char *seen = NULL;
        if (hi.len != lo.len) {
            PyErr_SetString(PyExc_ValueError, "lo and hi differ in length");
            goto done;
        }
        if (out.len / 8 < nblocks) {
            PyErr_SetString(PyExc_ValueError, "out is shorter than bits");
            goto done;
        }
        if (nblocks && !(seen = (unsigned char *)calloc((size_t)nblocks, 1))) {
            PyErr_NoMemory();
            goto done;
        }
        int64_t low = nblocks, high = -1;
        for (Py_ssize_t i = 0; i < n; i++) {
            if (b[i] <= a[i]) continue;
            const int64_t first = a[i] >> shift, last = (b[i] - 1) >> shift;
            if (a[i] < 0 || last >= nblocks) {
                PyErr_Format(PyExc_IndexError, "bytes [%lld, %lld) lie outside the %lld blocks of 2**%d bytes",
                             (long long)a[i], (long long)b[i], (long long)nblocks, shift);
                free(seen);
                goto done;
            }
            for (int64_t j = first; j <= last; j++) {
                if (!have[j] && !seen[j]) {
                    seen[j] = 1;
                    if (j < low) low = j;
                    if (j > high) high = j;
                }
            }
        }
        Py_ssize_t count = 0;
        for (int64_t j = low; j <= high; j++)
            if (seen[j]) dst[count++] = j;
        free(seen);
        result = PyLong_FromSsize_t(count);
    }
done:
    PyBuffer_Release(&out);
fail_bits:
    PyBuffer_Release(&bits);
fail_hi:
    PyBuffer_Release(&hi);
fail_lo:
    PyBuffer_Release(&lo);
    return result;
}

static PyMethodDef methods[] = {
    {"gather", gather, METH_VARARGS,
     "gather(src, starts, lengths, itemsize, dst): copy item ranges of src into dst, GIL released."},
    {"take_rows", take_rows, METH_VARARGS,
     "take_rows(sources, which, rows, rowbytes, dst, positions=None): dst[i] (or dst[positions[i]]) = "
     "sources[which[i]][rows[i]], GIL released."},
    {"split", split, METH_VARARGS, "split(values, offsets, utf8): the items of a ragged byte buffer as a list."},
    {"offsets_match", offsets_match, METH_VARARGS,
     "offsets_match(offsets, lengths, total): whether an offsets table is sound and agrees with lengths."},
    {"spans", spans, METH_VARARGS, "spans(buffers, addresses, lengths): each buffer's address and size."},
    {"take_sharded", take_sharded, METH_VARARGS,
     "take_sharded(sources, starts, indices, rowbytes, dst, ready=None, offsets=None, shift=0, record=None): dst[i] = the row of "
     "dataset index indices[i] in its shard's source (its blocks ready), GIL released; -1, or the position of the "
     "first index not readable here (nothing copied)."},
    {"xxh3_blocks", xxh3_blocks, METH_VARARGS,
     "xxh3_blocks(buf, ids, shift, end, out): XXH3-64 of each block of buf, GIL released."},
    {"write_blocks", write_blocks, METH_VARARGS,
     "write_blocks(fd, offset, piece, shift, end, table, published, carry=None): write a piece of a shard and "
     "verify the blocks it completes, GIL released."},
    {"missing_blocks", missing_blocks, METH_VARARGS,
     "missing_blocks(lo, hi, shift, bits, out): the blocks the byte ranges touch whose bit is not set, ascending, "
     "into out; returns how many."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_ranges", "Ranged gathers, GIL released.", -1, methods};

PyMODINIT_FUNC PyInit__ranges(void) { return PyModule_Create(&module); }
