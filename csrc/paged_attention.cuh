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
// Work split: one thread block per (sequence, KV head, chunk of up to kMaxGroup of its
// query heads) work item, so a GQA group's K/V are read once for all its query heads
// (Llama-3-8B: 4 query heads per KV head, one item per (sequence, KV head)). GQA: query
// head h reads KV head h / (num_q_heads / num_kv_heads), as vLLM does.
// Inside a block, a token's K (or V) row is read by a "lane group" of lanes_per_token
// lanes with 16-byte loads (8 fp16/bf16 or 4 fp32 elements per lane), so a warp covers
// 32 / lanes_per_token tokens per load and each lane group keeps kTokensPerIter tokens'
// loads in flight before using any (independent loads hide the memory's latency).
// Each lane group keeps an online-softmax state per query head (running max, running sum,
// accumulator; Milakov & Gimelshein 2018, as in FlashAttention); the states are merged
// across the lane groups of a warp with shuffles, then across warps through shared memory.
// The first GPU run of the earlier one-block-per-(sequence, query head) kernel with scalar
// loads reached 62 GB/s on the polling kernel's one-block-per-SM grid (H100,
// benchmarks/results/gpu_h100/): too few loads in flight per SM, and each K/V row read once
// per query head. This one took 116-149 us for the same task there (326-419 GB/s), still
// about 7 us per 64-token iteration of a block, one block per SM (~190 registers); not
// profiled yet.
#pragma once

#include "weaver_common.cuh"

namespace weaver {

constexpr int kNumWarps = 8;
constexpr int kThreads = kNumWarps * 32;
constexpr int kMaxHeadSize = 256;
constexpr int kMaxGroup = 4;       // query heads one item serves (per-lane state grows with it)
constexpr int kTokensPerIter = 4;  // tokens per lane group with loads in flight
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
  int head_size;           // a multiple of 8 (weaver/offload/cuda/region_desc.py checks)
  int block_size;
  int block_table_stride;
  int num_blocks;      // pool size: block ids outside [0, num_blocks) are an error
  int sliding_window;  // <= 0: none
  float scale;
  float softcap;  // <= 0: none
  int kv_format;  // 0: "pages", 1: "token" (weaver/offload/layout.py KV_FORMATS)
};

struct AttnShared {
  float max[kNumWarps][kMaxGroup];
  float sum[kNumWarps][kMaxGroup];
  float acc[kNumWarps][kMaxGroup][kMaxHeadSize];
};

// 16 bytes, loaded with one vector instruction (the pool, q and out are 16-byte aligned:
// head_size is a multiple of 8 and the region's sections are cache-line aligned).
struct __align__(16) Vec16 {
  u32 w[4];
};

// The 16 / sizeof(T) elements of a Vec16 as floats.
template <class Dt>
__device__ __forceinline__ void unpack(const Vec16& v, float* out) {
  if (sizeof(typename Dt::T) == 4) {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = __uint_as_float(v.w[i]);
  } else {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = Dt::load(static_cast<typename Dt::T>(v.w[i] & 0xffffu));
      out[2 * i + 1] = Dt::load(static_cast<typename Dt::T>(v.w[i] >> 16));
    }
  }
}

__device__ __forceinline__ int num_group_chunks(const AttnParams& p) {
  const int group = p.num_q_heads / p.num_kv_heads;
  return (group + kMaxGroup - 1) / kMaxGroup;
}

// Work items of one attention call (kernels.py attention_items computes the same).
__device__ __forceinline__ int num_attention_items(const AttnParams& p) {
  return p.num_seqs * p.num_kv_heads * num_group_chunks(p);
}

// The sequence, KV head and query heads [head0, head0 + num_heads) of one work item.
struct ItemHeads {
  int seq;
  int kv_head;
  int head0;
  int num_heads;
};

__device__ __forceinline__ ItemHeads item_heads(const AttnParams& p, int item) {
  const int chunks = num_group_chunks(p);
  const int group = p.num_q_heads / p.num_kv_heads;
  ItemHeads heads;
  heads.seq = item / (p.num_kv_heads * chunks);
  const int rest = item - heads.seq * p.num_kv_heads * chunks;
  heads.kv_head = rest / chunks;
  const int chunk = rest - heads.kv_head * chunks;
  heads.head0 = heads.kv_head * group + chunk * kMaxGroup;
  heads.num_heads = min(kMaxGroup, group - chunk * kMaxGroup);
  return heads;
}

// Online-softmax merge of (m_b, s_b, acc_b) into (m_a, s_a, acc_a); a side that saw no
// token has max -inf and contributes nothing.
__device__ __forceinline__ void merge_factors(float m_a, float m_b, float& f_a, float& f_b,
                                              float& m_out) {
  m_out = fmaxf(m_a, m_b);
  f_a = m_a == kNegInf ? 0.0f : __expf(m_a - m_out);
  f_b = m_b == kNegInf ? 0.0f : __expf(m_b - m_out);
}

// The block ids of tokens start .. start + kTokensPerIter - 1 of a sequence of seq_len
// tokens, read unconditionally: a token past the end reads the last token's entry (the
// caller masks it), so the loads need no branch.
__device__ __forceinline__ void load_block_ids(const int* table, int start, int seq_len,
                                               int block_size, int* blocks) {
  const int last = seq_len > 0 ? seq_len - 1 : 0;
#pragma unroll
  for (int j = 0; j < kTokensPerIter; ++j) blocks[j] = table[min(start + j, last) / block_size];
}

// Floats of one span's partial state (attend_span with a `partial` destination): per
// query head of the item, its max, its sum, then head_size unnormalised accumulators.
__device__ __forceinline__ int partial_floats(const AttnParams& p) {
  return kMaxGroup * (2 + p.head_size);
}

// Computes one item (see the work split above) with the whole block, over the item's
// tokens in [t_begin, t_end) (FlashDecoding's split of the context: a task of few
// sequences spreads over more blocks). With partial == nullptr the span is the whole
// context and the normalised output is written; otherwise the span's online-softmax state
// goes to partial (partial_floats(p) floats; merge_spans combines them). Returns false
// (and writes zeros) when the item's length does not fit its block table row or it reads
// a block id outside the pool, so a corrupt task cannot read outside the pool. Every
// thread of the block must call it (it synchronises).
// kVecs: 16-byte vectors per lane per row: 1, or 2 for fp32 rows longer than 128.
template <class Dt, int kVecs>
__device__ bool attend_span(const AttnParams& p, int item, int t_begin, int t_end,
                            AttnShared& shared, float* partial) {
  typedef typename Dt::T T;
  constexpr int kPerVec = 16 / static_cast<int>(sizeof(T));
  constexpr int kElems = kVecs * kPerVec;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int head_size = p.head_size;

  // Lane geometry: a row of head_size / kPerVec vectors is read by lanes_per_token lanes
  // (a power of two, at most 32), each holding up to kVecs of them.
  const int vecs_per_row = head_size / kPerVec;
  int lanes_per_token = 1;
  while (lanes_per_token < vecs_per_row && lanes_per_token < 32) lanes_per_token <<= 1;
  const int groups_per_warp = 32 / lanes_per_token;
  const int sub = lane & (lanes_per_token - 1);
  const int token_group = warp * groups_per_warp + lane / lanes_per_token;
  const int tokens_per_iter = kNumWarps * groups_per_warp * kTokensPerIter;

  const ItemHeads heads = item_heads(p, item);
  const int seq = heads.seq;
  const int kv_head = heads.kv_head;
  const int head0 = heads.head0;
  const int num_heads = heads.num_heads;

  // A length the block table cannot hold would read past the sequence's table row.
  const int claimed_len = p.seq_lens[seq];
  const bool is_len_ok =
      claimed_len >= 1 && static_cast<i64>(claimed_len) <= static_cast<i64>(p.block_table_stride) * p.block_size;
  const int seq_len = is_len_ok ? claimed_len : 0;
  const int window_first = p.sliding_window > 0 && seq_len > p.sliding_window
                               ? seq_len - p.sliding_window
                               : 0;
  const int first = max(window_first, t_begin);
  const int end = min(seq_len, t_end);  // the span's end: tokens past it are not read

  float q[kMaxGroup][kElems];
  float acc[kMaxGroup][kElems];
  float running_max[kMaxGroup];
  float running_sum[kMaxGroup];
#pragma unroll
  for (int g = 0; g < kMaxGroup; ++g) {
    running_max[g] = kNegInf;
    running_sum[g] = 0.0f;
    const T* q_ptr = static_cast<const T*>(p.q) + (static_cast<i64>(seq) * p.num_q_heads + head0 + g) * head_size;
#pragma unroll
    for (int n = 0; n < kVecs; ++n) {
      const int vec = n * lanes_per_token + sub;
      Vec16 raw = {{0u, 0u, 0u, 0u}};
      if (g < num_heads && vec < vecs_per_row) raw = reinterpret_cast<const Vec16*>(q_ptr)[vec];
      unpack<Dt>(raw, &q[g][n * kPerVec]);
    }
#pragma unroll
    for (int e = 0; e < kElems; ++e) acc[g][e] = 0.0f;
  }

  bool is_ok = is_len_ok;
  const i64 page_elems = 2LL * p.block_size * head_size;
  const bool is_token_rows = p.kv_format == 1;
  const i64 k_row_stride = is_token_rows ? 2LL * head_size : head_size;
  const i64 v_offset = is_token_rows ? head_size : static_cast<i64>(p.block_size) * head_size;
  const int* table = p.block_table + static_cast<i64>(seq) * p.block_table_stride;

  // Block ids of the lane group's tokens are fetched one iteration ahead, so an
  // iteration's K/V loads wait for one memory round trip, not two (table, then page);
  // every load is unconditional (an invalid token reads block 0, row 0, and is masked),
  // so the compiler issues them back to back instead of behind branches. The first
  // kernel on an H100 paid the table's round trip per token: ~4 us per iteration.
  int blocks[kTokensPerIter];
  load_block_ids(table, first + token_group * kTokensPerIter, end, p.block_size, blocks);
  // The bound is the same for the whole block, so every lane of a warp runs every
  // iteration (the shuffles below need the full warp).
  for (int base = first; base < end; base += tokens_per_iter) {
    Vec16 k_raw[kTokensPerIter][kVecs];
    Vec16 v_raw[kTokensPerIter][kVecs];
    bool is_valid[kTokensPerIter];
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      const int t = base + token_group * kTokensPerIter + j;
      const int block = blocks[j];
      const bool is_in_pool = block >= 0 && block < p.num_blocks;  // same for the lane group
      is_ok = is_ok && (t >= end || is_in_pool);
      is_valid[j] = t < end && is_in_pool;
      const int offset = is_valid[j] ? t - (t / p.block_size) * p.block_size : 0;
      const T* k_ptr = static_cast<const T*>(p.kv) +
                       (static_cast<i64>(is_valid[j] ? block : 0) * p.num_kv_heads + kv_head) * page_elems +
                       static_cast<i64>(offset) * k_row_stride;
      const T* v_ptr = k_ptr + v_offset;
#pragma unroll
      for (int n = 0; n < kVecs; ++n) {
        const int vec = n * lanes_per_token + sub;
        const int safe_vec = vec < vecs_per_row ? vec : 0;
        k_raw[j][n] = reinterpret_cast<const Vec16*>(k_ptr)[safe_vec];
        v_raw[j][n] = reinterpret_cast<const Vec16*>(v_ptr)[safe_vec];
        if (!is_valid[j] || vec >= vecs_per_row) {
          k_raw[j][n] = Vec16{{0u, 0u, 0u, 0u}};
          v_raw[j][n] = Vec16{{0u, 0u, 0u, 0u}};
        }
      }
    }
    load_block_ids(table, base + tokens_per_iter + token_group * kTokensPerIter, end,
                   p.block_size, blocks);
    float score[kTokensPerIter][kMaxGroup];
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      float k[kElems];
#pragma unroll
      for (int n = 0; n < kVecs; ++n) unpack<Dt>(k_raw[j][n], &k[n * kPerVec]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        float partial = 0.0f;
#pragma unroll
        for (int e = 0; e < kElems; ++e) partial += q[g][e] * k[e];
        // sum over the lane group: xor partners with a smaller mask stay inside it
        for (int mask = lanes_per_token >> 1; mask > 0; mask >>= 1)
          partial += __shfl_xor_sync(0xffffffffu, partial, mask);
        float s = partial * p.scale;
        if (p.softcap > 0.0f) s = tanhf(s / p.softcap) * p.softcap;
        score[j][g] = s;
      }
    }
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      float new_max = running_max[g];
#pragma unroll
      for (int j = 0; j < kTokensPerIter; ++j)
        if (is_valid[j]) new_max = fmaxf(new_max, score[j][g]);
      if (new_max == kNegInf) continue;  // no valid token in this lane group yet
      const float correction = __expf(running_max[g] - new_max);  // 0 on the first tokens
      running_sum[g] *= correction;
#pragma unroll
      for (int e = 0; e < kElems; ++e) acc[g][e] *= correction;
      running_max[g] = new_max;
    }
#pragma unroll
    for (int j = 0; j < kTokensPerIter; ++j) {
      float v[kElems];
#pragma unroll
      for (int n = 0; n < kVecs; ++n) unpack<Dt>(v_raw[j][n], &v[n * kPerVec]);
#pragma unroll
      for (int g = 0; g < kMaxGroup; ++g) {
        const float weight = is_valid[j] ? __expf(score[j][g] - running_max[g]) : 0.0f;
        running_sum[g] += weight;
#pragma unroll
        for (int e = 0; e < kElems; ++e) acc[g][e] += weight * v[e];
      }
    }
    if (__any_sync(0xffffffffu, !is_ok)) break;  // warp-uniform: a bad block id ends it
  }

  // Merge the lane groups of this warp: partners hold the same head dimensions.
  for (int mask = lanes_per_token; mask < 32; mask <<= 1) {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      const float other_max = __shfl_xor_sync(0xffffffffu, running_max[g], mask);
      const float other_sum = __shfl_xor_sync(0xffffffffu, running_sum[g], mask);
      float f_self, f_other, merged_max;
      merge_factors(running_max[g], other_max, f_self, f_other, merged_max);
      running_sum[g] = running_sum[g] * f_self + other_sum * f_other;
#pragma unroll
      for (int e = 0; e < kElems; ++e) {
        const float other_acc = __shfl_xor_sync(0xffffffffu, acc[g][e], mask);
        acc[g][e] = acc[g][e] * f_self + other_acc * f_other;
      }
      running_max[g] = merged_max;
    }
  }
  if (lane < lanes_per_token) {
#pragma unroll
    for (int g = 0; g < kMaxGroup; ++g) {
      if (lane == 0) {
        shared.max[warp][g] = running_max[g];
        shared.sum[warp][g] = running_sum[g];
      }
#pragma unroll
      for (int n = 0; n < kVecs; ++n) {
        const int vec = n * lanes_per_token + sub;
        if (vec < vecs_per_row) {
#pragma unroll
          for (int e = 0; e < kPerVec; ++e) shared.acc[warp][g][vec * kPerVec + e] = acc[g][n * kPerVec + e];
        }
      }
    }
  }
  const bool is_block_ok = __syncthreads_and(is_ok) != 0;

  // Merge the warps and write: one thread per (query head of the item, head element).
  const int stride = 2 + head_size;
  for (int index = threadIdx.x; index < num_heads * head_size; index += blockDim.x) {
    const int g = index / head_size;
    const int d = index - g * head_size;
    float block_max = kNegInf;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) block_max = fmaxf(block_max, shared.max[w][g]);
    float block_sum = 0.0f;
    float value = 0.0f;
#pragma unroll
    for (int w = 0; w < kNumWarps; ++w) {
      const float factor = shared.max[w][g] == kNegInf ? 0.0f : __expf(shared.max[w][g] - block_max);
      block_sum += shared.sum[w][g] * factor;
      value += shared.acc[w][g][d] * factor;
    }
    if (partial != nullptr) {
      if (d == 0) {
        partial[g * stride] = block_max;
        partial[g * stride + 1] = block_sum;
      }
      partial[g * stride + 2 + d] = value;
      continue;
    }
    const float inv_sum = block_sum > 0.0f && is_block_ok ? 1.0f / block_sum : 0.0f;
    T* out_ptr = static_cast<T*>(p.out) + (static_cast<i64>(seq) * p.num_q_heads + head0 + g) * head_size;
    out_ptr[d] = Dt::store(value * inv_sum);
  }
  __syncthreads();  // shared is reused by the next item
  return is_block_ok;
}

// One whole item, its normalised output written (the standalone kernel, the poll kernel).
template <class Dt, int kVecs>
__device__ __forceinline__ bool attend_item(const AttnParams& p, int item, AttnShared& shared) {
  return attend_span<Dt, kVecs>(p, item, 0, 0x7fffffff, shared, nullptr);
}

// Writes item's output from its num_spans partial states (partial_floats(p) floats each,
// consecutive), written by other blocks of this grid: the caller has fenced after seeing
// every span counted. Loads bypass L1 (.cg), which is not coherent across blocks; they
// are independent, so the compiler may keep several in flight. Every thread of the block
// calls it.
template <class Dt>
__device__ void merge_spans(const AttnParams& p, int item, int num_spans, const float* spans,
                            bool is_ok) {
  typedef typename Dt::T T;
  const ItemHeads heads = item_heads(p, item);
  const int seq = heads.seq;
  const int head0 = heads.head0;
  const int num_heads = heads.num_heads;
  const int head_size = p.head_size;
  const int stride = 2 + head_size;
  const int span_floats = partial_floats(p);
  for (int index = threadIdx.x; index < num_heads * head_size; index += blockDim.x) {
    const int g = index / head_size;
    const int d = index - g * head_size;
    float total_max = kNegInf;
    for (int s = 0; s < num_spans; ++s)
      total_max = fmaxf(total_max, __ldcg(spans + static_cast<i64>(s) * span_floats + g * stride));
    float total_sum = 0.0f;
    float value = 0.0f;
    for (int s = 0; s < num_spans; ++s) {
      const float* span = spans + static_cast<i64>(s) * span_floats + g * stride;
      const float m = __ldcg(span);
      const float factor = m == kNegInf ? 0.0f : __expf(m - total_max);
      total_sum += __ldcg(span + 1) * factor;
      value += __ldcg(span + 2 + d) * factor;
    }
    const float inv_sum = total_sum > 0.0f && is_ok ? 1.0f / total_sum : 0.0f;
    T* out_ptr = static_cast<T*>(p.out) + (static_cast<i64>(seq) * p.num_q_heads + head0 + g) * head_size;
    out_ptr[d] = Dt::store(value * inv_sum);
  }
}

}  // namespace weaver
