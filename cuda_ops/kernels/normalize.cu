// fastload.cuda_ops :: normalize_batch
//
// One pass over a uint8 NHWC image batch: per-sample horizontal flip, per-channel
// (x - mean[c]) / std[c] in float32 (IEEE division), cast to the output type with
// round-to-nearest-even, written as NCHW or NHWC. Semantics are defined by
// fastload.cuda_ops.normalize.normalize_batch_reference; every kernel below matches it bit for bit.
//
// Three kernels, chosen by the host (fastload/cuda_ops/normalize.py, _launch_normalize):
//
// * fl_normalize_vec_*: the common case, 3 channels with W % 4 == 0, the source 4-byte and the
//   output 4-element aligned, and a sample of fewer than 2**31 elements. Each thread handles 4
//   consecutive pixels of one row: three 32-bit loads of 12 source bytes (a flipped sample reads
//   the mirrored group of 4 and reverses the pixels in registers) and vector stores: per plane
//   4 outputs (8 or 16 bytes) for NCHW, 12 outputs as three 8- or 16-byte stores for NHWC: a
//   quarter of the generic kernel's memory instructions, each one wider. mean/std sit in
//   registers; offsets within a sample are 32-bit, the sample base is 64-bit.
// * fl_normalize_vec8_{f16,bf16}: the same with 8 pixels per thread, for 16-bit outputs, whose
//   4-pixel stores are only 8 bytes wide (W % 8 == 0, the source 8-byte and the output 8-element
//   aligned): three 64-bit loads of 24 source bytes and 16-byte stores, per plane 8 outputs for
//   NCHW, 24 outputs as three stores for NHWC. One template serves both group sizes. Chosen only
//   when asked for (`kernel="vec8"`) until it has been measured against the 4-pixel kernel.
// * fl_normalize_*: every other shape, alignment or channel count. One thread per pixel, C byte
//   loads and C scalar stores, 64-bit offsets.
//
// Grid (all): blockIdx.y walks samples, blockIdx.x * blockDim.y + threadIdx.y walks rows,
// threadIdx.x walks columns (pixels, or groups of 4 or 8 pixels); every level loops with its grid
// stride, so any B, H, W is covered whatever the launch size (gridDim.y is capped at 65535 by
// the host). No integer division per pixel.
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

// G consecutive outputs packed for one vector store: G = 4 gives a float4 (16 bytes) for float
// and a uint2 (8 bytes) for __half / __nv_bfloat16; G = 8 (16-bit types only) gives a uint4
// (16 bytes). The kernel indexes a V* base pointer, so the compiler keeps each store whole.
template <typename T, int G> struct fl_vec { typedef uint2 type; };
template <> struct fl_vec<float, 4> { typedef float4 type; };
template <typename T> struct fl_vec<T, 8> { typedef uint4 type; };
__device__ __forceinline__ unsigned fl_bits(__half v) { return static_cast<__half_raw>(v).x; }
__device__ __forceinline__ unsigned fl_bits(__nv_bfloat16 v) { return static_cast<__nv_bfloat16_raw>(v).x; }
template <typename T> __device__ __forceinline__ unsigned fl_pair(const T* v) {
    return fl_bits(v[0]) | fl_bits(v[1]) << 16;
}
__device__ __forceinline__ float4 fl_pack(const float* v, float4*) { return make_float4(v[0], v[1], v[2], v[3]); }
template <typename T> __device__ __forceinline__ uint2 fl_pack(const T* v, uint2*) {
    return make_uint2(fl_pair(v), fl_pair(v + 2));
}
template <typename T> __device__ __forceinline__ uint4 fl_pack(const T* v, uint4*) {
    return make_uint4(fl_pair(v), fl_pair(v + 2), fl_pair(v + 4), fl_pair(v + 6));
}

// The source bytes of a group of G pixels (3 G bytes) come in three loads of G bytes: 32-bit words
// for G = 4, uint2 for G = 8; fl_words splits a load into 32-bit words.
template <int G> struct fl_src { typedef unsigned type; };
template <> struct fl_src<8> { typedef uint2 type; };
__device__ __forceinline__ void fl_words(unsigned v, unsigned* w) { w[0] = v; }
__device__ __forceinline__ void fl_words(uint2 v, unsigned* w) {
    w[0] = v.x;
    w[1] = v.y;
}

template <typename T, int G>
__device__ __forceinline__ void fl_normalize_vec_impl(
    const unsigned char* __restrict__ src,  // (B, H, W, 3) uint8, contiguous, G-byte aligned
    T* __restrict__ dst,                    // (B, 3, H, W) if nchw else (B, H, W, 3), contiguous, G-element aligned
    const unsigned char* __restrict__ flip, // (B,) 0/1, or nullptr for no flip
    const float* __restrict__ mean,         // (3,)
    const float* __restrict__ stdv,         // (3,)
    fl_i64 batch, int height, int width, int nchw) {  // W % G == 0, 3 * H * W < 2**31
    typedef typename fl_vec<T, G>::type V;
    typedef typename fl_src<G>::type L;
    constexpr int WORDS = 3 * G / 4;  // 32-bit source words per group of G pixels
    const float m[3] = {mean[0], mean[1], mean[2]};
    const float sd[3] = {stdv[0], stdv[1], stdv[2]};
    const int groups = width / G;        // groups of G pixels per row
    const int plane_g = height * groups;  // one output plane in V units
    const int row_step = gridDim.x * blockDim.y;
    for (fl_i64 b = blockIdx.y; b < batch; b += gridDim.y) {
        const bool flipped = flip != nullptr && flip[b] != 0;
        const L* src_img = reinterpret_cast<const L*>(src) + b * 3 * plane_g;  // 3 L per group
        V* dst_img = reinterpret_cast<V*>(dst) + b * 3 * plane_g;  // 3 V per group
        for (int h = blockIdx.x * blockDim.y + threadIdx.y; h < height; h += row_step) {
            for (int g = threadIdx.x; g < groups; g += blockDim.x) {
                const L* s = src_img + 3 * (h * groups + (flipped ? groups - 1 - g : g));
                unsigned word[WORDS];
#pragma unroll
                for (int k = 0; k < 3; ++k) fl_words(s[k], word + k * (G / 4));
                float x[3 * G];  // x[3 * pixel + channel]: the group's bytes in memory order
#pragma unroll
                for (int k = 0; k < 3 * G; ++k) x[k] = (float)((word[k / 4] >> (8 * (k % 4))) & 0xFFu);
                if (flipped) {  // the mirrored group: pixels in reverse order
#pragma unroll
                    for (int p = 0; p < G / 2; ++p) {
#pragma unroll
                        for (int c = 0; c < 3; ++c) {
                            const float t = x[3 * p + c];
                            x[3 * p + c] = x[3 * (G - 1 - p) + c];
                            x[3 * (G - 1 - p) + c] = t;
                        }
                    }
                }
                T y[3 * G];  // y[3 * pixel + channel]: the outputs in NHWC order
#pragma unroll
                for (int k = 0; k < 3 * G; ++k) y[k] = fl_from_float<T>((x[k] - m[k % 3]) / sd[k % 3]);
                const int i = h * groups + g;  // this group's index within a plane
                if (nchw) {
#pragma unroll
                    for (int c = 0; c < 3; ++c) {
                        T v[G];
#pragma unroll
                        for (int p = 0; p < G; ++p) v[p] = y[3 * p + c];
                        dst_img[c * plane_g + i] = fl_pack(v, (V*)nullptr);
                    }
                } else {
#pragma unroll
                    for (int k = 0; k < 3; ++k) dst_img[3 * i + k] = fl_pack(y + G * k, (V*)nullptr);
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

#define FL_NORMALIZE_VEC_ENTRY(NAME, T, G)                                                               \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ src, T* __restrict__ dst,           \
                                    const unsigned char* __restrict__ flip, const float* __restrict__ mean, \
                                    const float* __restrict__ stdv, fl_i64 batch, int height, int width,   \
                                    int nchw) {                                                           \
        fl_normalize_vec_impl<T, G>(src, dst, flip, mean, stdv, batch, height, width, nchw);             \
    }

FL_NORMALIZE_VEC_ENTRY(fl_normalize_vec_f32, float, 4)
FL_NORMALIZE_VEC_ENTRY(fl_normalize_vec_f16, __half, 4)
FL_NORMALIZE_VEC_ENTRY(fl_normalize_vec_bf16, __nv_bfloat16, 4)
FL_NORMALIZE_VEC_ENTRY(fl_normalize_vec8_f16, __half, 8)
FL_NORMALIZE_VEC_ENTRY(fl_normalize_vec8_bf16, __nv_bfloat16, 8)

