// Device helpers shared by Weaver's offload kernels (docs/architecture.md, part 4).
//
// No standard or CUDA headers are included on purpose: the files compile unchanged with
// NVRTC (no include path needed) and with nvcc. fp16/bf16 conversions are written with
// PTX or bit arithmetic instead of cuda_fp16.h / cuda_bf16.h for the same reason.
#pragma once

namespace weaver {

typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;

// ---- memory ordering -------------------------------------------------------------------
// The counters are read and written by two processes, possibly on two GPUs over peer
// access, so every fence and ordered access is at system scope (PTX ISA, "Memory
// Consistency Model": release/acquire patterns). Plain (non-atomic) stores suffice for
// the counters: each side writes only its own counter and 8-byte aligned stores are
// single-copy atomic; no peer atomics are needed (they are not supported on every
// peer link).
__device__ __forceinline__ i64 ld_acquire_sys(const i64* ptr) {
  i64 value;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ i64 ld_relaxed_sys(const i64* ptr) {
  i64 value;
  asm volatile("ld.relaxed.sys.global.b64 %0, [%1];" : "=l"(value) : "l"(ptr) : "memory");
  return value;
}

__device__ __forceinline__ void st_release_sys(i64* ptr, i64 value) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(i64* ptr, i64 value) {
  asm volatile("st.relaxed.sys.global.b64 [%0], %1;" ::"l"(ptr), "l"(value) : "memory");
}

// Nanoseconds from the GPU's global timer: the time base for timeouts (a clock64 cycle
// count would drift with the SM clock) and for the benchmark's device-side timestamps.
__device__ __forceinline__ u64 globaltimer_ns() {
  u64 value;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(value));
  return value;
}

__device__ __forceinline__ void backoff_ns(u32 ns) {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 700
  __nanosleep(ns);
#endif
}

// ---- element types ---------------------------------------------------------------------
// Storage type + conversions to/from float; fp16/bf16 are stored as raw 16-bit words.
struct F32 {
  typedef float T;
  static __device__ __forceinline__ float load(T x) { return x; }
  static __device__ __forceinline__ T store(float x) { return x; }
};

struct F16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(T x) {
    float out;
    asm("cvt.f32.f16 %0, %1;" : "=f"(out) : "h"(x));
    return out;
  }
  static __device__ __forceinline__ T store(float x) {
    T out;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(out) : "f"(x));
    return out;
  }
};

struct BF16 {
  typedef unsigned short T;
  static __device__ __forceinline__ float load(T x) {
    return __uint_as_float(static_cast<u32>(x) << 16);
  }
  // Round to nearest even by bit arithmetic (cvt.rn.bf16.f32 needs sm_80; this also
  // builds for the default target when no -arch is given).
  static __device__ __forceinline__ T store(float x) {
    u32 bits = __float_as_uint(x);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<T>(0x7fc0u);  // NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<T>(bits >> 16);
  }
};

__device__ __forceinline__ float warp_sum(float value) {
#pragma unroll
  for (int mask = 16; mask > 0; mask >>= 1) value += __shfl_xor_sync(0xffffffffu, value, mask);
  return value;
}

}  // namespace weaver
