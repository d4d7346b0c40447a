// Paged decode attention over the offload region's KV pool layout (one query token per
// sequence), shared by the standalone kernel and the cold side's polling kernel.
//
// Pool layout of one layer: [num_blocks, num_kv_heads, block_size, 2 * head_size], vLLM's
// logical per-layer cache view (weaver/offload/layout.py), in one of two KV formats
// (layout.KV_FORMATS): "pages", CPU_ATTN's, where each (block, kv head) page holds K as
// [block_size, head_size] (token-major, "nd" in weaver/offload/reference_attention.py)
// then V as [block_size, head_size]; or "token", the GPU backends' (FLASH_ATTN,
// TRITON_ATTN: ``kv_cache.transpose(1, 2).split(head_size, dim=-1)``), where each token's
// row holds K then V. The page of a (block, kv head) is the same 2 * block_size *
// head_size elements in both; only the row stride and V's offset in it differ.
//
// Work split: one thread block per (sequence, query head) work item; the block's warps
// take groups of kTokensPerIter tokens round-robin, each warp keeps an online-softmax state (running max, running
// sum, accumulator; Milakov & Gimelshein 2018, as in FlashAttention), and the warps'
// states are merged through shared memory at the end. GQA: query head h reads KV head
// h / (num_q_heads / num_kv_heads), as vLLM does.
#pragma once

#include "weaver_common.cuh"

namespace weaver {

constexpr int kNumWarps = 4;
constexpr int kThreads = kNumWarps * 32;
constexpr int kMaxHeadSize = 256;
constexpr int kTokensPerIter = 4;
// -inf without math.h (NVRTC has no INFINITY macro)
#define kNegInf __int_as_float(0xff800000)

struct AttnParams {
  const void* q;           // [num_seqs, num_q_heads, head_size]
  const void* kv;          // [num_blocks, num_kv_heads, block_size, 2 * head_size]
  const int* seq_lens;     // [num_seqs], tokens including the new one
  const int* block_table;  // [num_seqs, block_table_stride]
  void* out;               // [num_seqs, num_q_heads, head_size]
  int num_seqs;
  int num_q_heads;
  int num_kv_heads;
  int head_size;
  int block_size;
  int block_table_stride;
  int num_blocks;      // pool size: block ids outside [0, num_blocks) are an error
  int sliding_window;  // <= 0: none
  float scale;
  float softcap;  // <= 0: none
  int kv_format;  // 0: "pages", 1: "token" (weaver/offload/layout.py KV_FORMATS)
};

struct AttnShared {
  float max[kNumWarps];
  float sum[kNumWarps];
  float acc[kNumWarps][kMaxHeadSize];
};

// Computes one (seq, q head) item with the whole block. Returns false (and writes zeros)
// when the item's length does not fit its block table row or it reads a block id outside
// the pool, so a corrupt task cannot read outside the pool. Every thread of the block
// must call it (it synchronises).
// kElems: head elements per lane (head_size <= 32 * kElems); 4 for head sizes up to 128
// keeps the register arrays half the size of the 256 variant.
template <class Dt, int kElems>
__device__ bool attend_item(const AttnParams& p, int item, AttnShared& shared) {
  typedef typename Dt::T T;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int seq = item / p.num_q_heads;
  const int q_head = item - seq * p.num_q_heads;
  const int kv_head = q_head / (p.num_q_heads / p.num_kv_heads);
  const int head_size = p.head_size;
  // A length the block table cannot hold would read past the sequence's table row.
  const int claimed_len = p.seq_lens[seq];
  const bool is_len_ok =
      claimed_len >= 1 && static_cast<i64>(claimed_len) <= static_cast<i64>(p.block_table_stride) * p.block_size;
  const int seq_len = is_len_ok ? claimed_len : 0;
  const int first = p.sliding_window > 0 && seq_len > p.sliding_window
                        ? seq_len - p.sliding_window
                        : 0;

  const T* q_ptr = static_cast<const T*>(p.q) + (static_cast<i64>(seq) * p.num_q_heads + q_head) * head_size;
  float q[kElems];
  float acc[kElems];
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    const int d = lane + 32 * i;
    q[i] = d < head_size ? Dt::load(q_ptr[d]) : 0.0f;
    acc[i] = 0.0f;
  }
  float running_max = kNegInf;
  float running_sum = 0.0f;
  bool is_ok = is_len_ok;
  const i64 page_elems = 2LL * p.block_size * head_size;
  const bool is_token_rows = p.kv_format == 1;
  const i64 k_row_stride = is_token_rows ? 2LL * head_size : head_size;
  const i64 v_offset = is_token_rows ? head_size : static_cast<i64>(p.block_size) * head_size;
  const int* table = p.block_table + static_cast<i64>(seq) * p.block_table_stride;

  // Each warp takes kTokensPerIter consecutive tokens per iteration and issues all their
  // K and V loads before using any: several independent loads in flight per lane hide
  // memory latency (HOPPER.md "several independent loads in flight before the first use").
  for (int t0 = first + warp * kTokensPerIter; t0 < seq_len; t0 += kNumWarps * kTokensPerIter) {
    float k[kTokensPerIter][kElems];
    float v[kTokensPerIter][kElems];
    bool is_valid[kTokensPerIter];
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      const int t = t0 + j;
      const int block = t < seq_len ? table[t / p.block_size] : 0;
      const bool is_in_pool = block >= 0 && block < p.num_blocks;  // same for every lane
      is_ok = is_ok && is_in_pool;
      is_valid[j] = t < seq_len && is_in_pool;
      const int offset = t - (t / p.block_size) * p.block_size;
      const T* k_ptr = static_cast<const T*>(p.kv) +
                       (static_cast<i64>(block) * p.num_kv_heads + kv_head) * page_elems +
                       static_cast<i64>(offset) * k_row_stride;
      const T* v_ptr = k_ptr + v_offset;
#pragma unroll
      for (int i = 0; i < kElems; ++i) {
        const int d = lane + 32 * i;
        const bool is_loaded = is_valid[j] && d < head_size;
        k[j][i] = is_loaded ? Dt::load(k_ptr[d]) : 0.0f;
        v[j][i] = is_loaded ? Dt::load(v_ptr[d]) : 0.0f;
      }
    }
    float score[kTokensPerIter];
    float new_max = running_max;
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      float partial = 0.0f;
#pragma unroll
      for (int i = 0; i < kElems; ++i) partial += q[i] * k[j][i];
      score[j] = warp_sum(partial) * p.scale;
      if (p.softcap > 0.0f) score[j] = tanhf(score[j] / p.softcap) * p.softcap;
      if (is_valid[j]) new_max = fmaxf(new_max, score[j]);
    }
    if (new_max == kNegInf) break;  // only out-of-pool tokens: nothing to add
    const float correction = __expf(running_max - new_max);  // 0 on the first tokens
    running_sum *= correction;
#pragma unroll
    for (int i = 0; i < kElems; ++i) acc[i] *= correction;
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      const float weight = is_valid[j] ? __expf(score[j] - new_max) : 0.0f;
      running_sum += weight;
#pragma unroll
      for (int i = 0; i < kElems; ++i) acc[i] += weight * v[j][i];
    }
    running_max = new_max;
    if (!is_ok) break;
  }

  if (lane == 0) {
    shared.max[warp] = running_max;
    shared.sum[warp] = running_sum;
  }
#pragma unroll
  for (int i = 0; i < kElems; ++i) {
    const int d = lane + 32 * i;
    if (d < head_size) shared.acc[warp][d] = acc[i];
  }
  const bool is_block_ok = __syncthreads_and(is_ok) != 0;

  float block_max = kNegInf;
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) block_max = fmaxf(block_max, shared.max[w]);
  float block_sum = 0.0f;
  float factor[kNumWarps];
#pragma unroll
  for (int w = 0; w < kNumWarps; ++w) {
    // a warp that saw no token has max -inf and contributes nothing
    factor[w] = shared.max[w] == kNegInf ? 0.0f : __expf(shared.max[w] - block_max);
    block_sum += shared.sum[w] * factor[w];
  }
  const float inv_sum = block_sum > 0.0f && is_block_ok ? 1.0f / block_sum : 0.0f;
  T* out_ptr = static_cast<T*>(p.out) + (static_cast<i64>(seq) * p.num_q_heads + q_head) * head_size;
  for (int d = threadIdx.x; d < head_size; d += blockDim.x) {
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) value += shared.acc[w][d] * factor[w];
    out_ptr[d] = Dt::store(value * inv_sum);
  }
  __syncthreads();  // shared is reused by the next item
  return is_block_ok;
}

}  // namespace weaver
