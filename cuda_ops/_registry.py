"""Entry points of each `kernels/<name>.cu`: the `extern "C" __global__` functions the launchers call."""

from __future__ import annotations

__all__ = ["ENTRY_POINTS", "NORMALIZE_FUNCTIONS", "NORMALIZE_VEC8_FUNCTIONS", "NORMALIZE_VEC_FUNCTIONS",
           "PAD_RAGGED_SUFFIXES"]

# torch dtype name -> entry point: the generic kernel (one pixel per thread) and the vectorized ones
# (3 channels, 4 pixels per thread; 8 pixels per thread for 16-bit outputs).
NORMALIZE_FUNCTIONS = {"float32": "fl_normalize_f32", "float16": "fl_normalize_f16", "bfloat16": "fl_normalize_bf16"}
NORMALIZE_VEC_FUNCTIONS = {"float32": "fl_normalize_vec_f32", "float16": "fl_normalize_vec_f16",
                           "bfloat16": "fl_normalize_vec_bf16"}
NORMALIZE_VEC8_FUNCTIONS = {"float16": "fl_normalize_vec8_f16", "bfloat16": "fl_normalize_vec8_bf16"}

# torch dtype name -> kernel type suffix; every suffix has an int64-mask ("_m64") and a bool-mask ("_mb") variant.
PAD_RAGGED_SUFFIXES = {
    "int8": "i8", "uint8": "u8", "int16": "i16", "uint16": "u16",
    "int32": "i32", "uint32": "u32", "int64": "i64", "uint64": "u64",
}

ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "normalize": (*NORMALIZE_FUNCTIONS.values(), *NORMALIZE_VEC_FUNCTIONS.values(), *NORMALIZE_VEC8_FUNCTIONS.values()),
    "pad_ragged": tuple(f"fl_pad_ragged_{s}_{m}" for s in PAD_RAGGED_SUFFIXES.values() for m in ("m64", "mb")),
}
