// fastload.cuda_ops :: pad_ragged
//
// Ragged token buffer (flat values + int64 offsets of length B+1) -> right-padded (B, L)
// batch, its attention mask and (optionally) int64 labels padded with their own value.
// Semantics are defined by fastload.cuda_ops.ragged.pad_ragged_reference. The host has
// already validated offsets (non-decreasing, in range) and chosen L.
//
// Grid: blockIdx.y walks rows (grid-stride, gridDim.y <= 65535), blockIdx.x * blockDim.x
// + threadIdx.x walks columns (grid-stride). Reads of a row are contiguous, writes are
// contiguous; all offsets are 64-bit. values[] is only read for j < row length.
//
// Compiled by NVRTC at first use (see fastload/cuda_ops/_nvrtc.py) and by `nvcc -cubin` in tests.

typedef long long fl_i64;

template <typename T, typename M>
__device__ __forceinline__ void fl_pad_ragged_impl(
    const T* __restrict__ values,        // flat tokens
    const fl_i64* __restrict__ offsets,  // (B + 1,) row r is values[offsets[r] : offsets[r + 1]]
    T* __restrict__ out,                 // (B, L)
    M* __restrict__ mask,                // (B, L): 1 for tokens, 0 for padding
    fl_i64* __restrict__ labels,         // (B, L) or nullptr
    fl_i64 batch, fl_i64 length, fl_i64 pad_value, fl_i64 labels_pad_value) {
    const T pad = (T)pad_value;
    const fl_i64 col_step = (fl_i64)gridDim.x * blockDim.x;
    for (fl_i64 b = blockIdx.y; b < batch; b += gridDim.y) {
        const fl_i64 start = offsets[b];
        fl_i64 n = offsets[b + 1] - start;
        if (n > length) n = length;  // truncation to max_len
        const fl_i64 row = b * length;
        for (fl_i64 j = (fl_i64)blockIdx.x * blockDim.x + threadIdx.x; j < length; j += col_step) {
            const bool token = j < n;
            const T v = token ? values[start + j] : pad;
            out[row + j] = v;
            mask[row + j] = (M)(token ? 1 : 0);
            if (labels != nullptr) labels[row + j] = token ? (fl_i64)v : labels_pad_value;
        }
    }
}

#define FL_PAD_RAGGED_ENTRY(NAME, T, M)                                                                    \
    extern "C" __global__ void NAME(const T* __restrict__ values, const fl_i64* __restrict__ offsets,      \
                                    T* __restrict__ out, M* __restrict__ mask, fl_i64* __restrict__ labels, \
                                    fl_i64 batch, fl_i64 length, fl_i64 pad_value, fl_i64 labels_pad_value) { \
        fl_pad_ragged_impl<T, M>(values, offsets, out, mask, labels, batch, length, pad_value,             \
                                 labels_pad_value);                                                        \
    }

// Value types by torch dtype; mask as int64 ("m64") or bool stored as one byte ("mb").
#define FL_PAD_RAGGED_DTYPE(SUFFIX, T)                                       \
    FL_PAD_RAGGED_ENTRY(fl_pad_ragged_##SUFFIX##_m64, T, fl_i64)             \
    FL_PAD_RAGGED_ENTRY(fl_pad_ragged_##SUFFIX##_mb, T, unsigned char)

FL_PAD_RAGGED_DTYPE(i8, signed char)
FL_PAD_RAGGED_DTYPE(u8, unsigned char)
FL_PAD_RAGGED_DTYPE(i16, short)
FL_PAD_RAGGED_DTYPE(u16, unsigned short)
FL_PAD_RAGGED_DTYPE(i32, int)
FL_PAD_RAGGED_DTYPE(u32, unsigned int)
FL_PAD_RAGGED_DTYPE(i64, long long)
FL_PAD_RAGGED_DTYPE(u64, unsigned long long)
