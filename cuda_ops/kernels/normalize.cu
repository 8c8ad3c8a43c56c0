// fastload.cuda_ops :: normalize_batch
//
// One pass over a uint8 NHWC image batch: per-sample horizontal flip, per-channel
// (x - mean[c]) / std[c] in float32, cast to the output type, written as NCHW or NHWC.
// Semantics are defined by fastload.cuda_ops.normalize.normalize_batch_reference.
//
// Grid: blockIdx.y walks samples, blockIdx.x * blockDim.y + threadIdx.y walks rows,
// threadIdx.x walks columns; every level loops with its grid stride, so any B, H, W is
// covered whatever the launch size (gridDim.y is capped at 65535 by the host). No integer
// division per pixel; all offsets are 64-bit.
//
// Compiled by NVRTC at first use (see fastload/cuda_ops/_nvrtc.py) and by `nvcc -cubin` in tests.
#include <cuda_fp16.h>
#include <cuda_bf16.h>

typedef long long fl_i64;

template <typename T> __device__ __forceinline__ T fl_from_float(float v);
template <> __device__ __forceinline__ float fl_from_float<float>(float v) { return v; }
template <> __device__ __forceinline__ __half fl_from_float<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 fl_from_float<__nv_bfloat16>(float v) {
    return __float2bfloat16_rn(v);
}

template <typename T>
__device__ __forceinline__ void fl_normalize_impl(
    const unsigned char* __restrict__ src,  // (B, H, W, C) uint8, contiguous
    T* __restrict__ dst,                    // (B, C, H, W) if nchw else (B, H, W, C), contiguous
    const unsigned char* __restrict__ flip, // (B,) 0/1, or nullptr for no flip
    const float* __restrict__ mean,         // (C,)
    const float* __restrict__ stdv,         // (C,)
    fl_i64 batch, fl_i64 height, fl_i64 width, fl_i64 channels, int nchw) {
    const fl_i64 plane = height * width;
    const fl_i64 row_step = (fl_i64)gridDim.x * blockDim.y;
    for (fl_i64 b = blockIdx.y; b < batch; b += gridDim.y) {
        const bool flipped = flip != nullptr && flip[b] != 0;
        for (fl_i64 h = (fl_i64)blockIdx.x * blockDim.y + threadIdx.y; h < height; h += row_step) {
            const unsigned char* src_row = src + (b * height + h) * width * channels;
            for (fl_i64 w = threadIdx.x; w < width; w += blockDim.x) {
                const fl_i64 sw = flipped ? (width - 1 - w) : w;
                const unsigned char* s = src_row + sw * channels;
                if (nchw) {
                    T* d = dst + b * channels * plane + h * width + w;
                    for (fl_i64 c = 0; c < channels; ++c) {
                        d[c * plane] = fl_from_float<T>(((float)s[c] - mean[c]) / stdv[c]);
                    }
                } else {
                    T* d = dst + ((b * height + h) * width + w) * channels;
                    for (fl_i64 c = 0; c < channels; ++c) {
                        d[c] = fl_from_float<T>(((float)s[c] - mean[c]) / stdv[c]);
                    }
                }
            }
        }
    }
}

#define FL_NORMALIZE_ENTRY(NAME, T)                                                                      \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ src, T* __restrict__ dst,           \
                                    const unsigned char* __restrict__ flip, const float* __restrict__ mean, \
                                    const float* __restrict__ stdv, fl_i64 batch, fl_i64 height,           \
                                    fl_i64 width, fl_i64 channels, int nchw) {                            \
        fl_normalize_impl<T>(src, dst, flip, mean, stdv, batch, height, width, channels, nchw);          \
    }

FL_NORMALIZE_ENTRY(fl_normalize_f32, float)
FL_NORMALIZE_ENTRY(fl_normalize_f16, __half)
FL_NORMALIZE_ENTRY(fl_normalize_bf16, __nv_bfloat16)
