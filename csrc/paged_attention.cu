// Standalone paged decode attention (same math as the polling kernel's): one thread block
// of weaver::kThreads threads per (sequence, query head); grid-stride over items so any
// grid size is correct. Launched by weaver/offload/cuda/kernels.py.
#include "paged_attention.cuh"

namespace weaver {

template <class Dt>
__device__ void paged_decode_attention(const AttnParams& p, int* error_flag) {
  __shared__ AttnShared shared;
  const int num_items = p.num_seqs * p.num_q_heads;
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const bool is_ok = attend_item<Dt>(p, item, shared);
    if (!is_ok && threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
  }
}

}  // namespace weaver

#define WEAVER_ATTENTION_KERNEL(NAME, DT)                                                      \
  extern "C" __global__ void __launch_bounds__(weaver::kThreads)                               \
      NAME(const void* q, const void* kv, const int* seq_lens, const int* block_table,         \
           void* out, int num_seqs, int num_q_heads, int num_kv_heads, int head_size,          \
           int block_size, int block_table_stride, int num_blocks, int sliding_window,         \
           float scale, float softcap, int* error_flag) {                                      \
    const weaver::AttnParams p = {q,           kv,           seq_lens,   block_table,          \
                                  out,         num_seqs,     num_q_heads, num_kv_heads,        \
                                  head_size,   block_size,   block_table_stride, num_blocks,   \
                                  sliding_window, scale,     softcap};                         \
    weaver::paged_decode_attention<DT>(p, error_flag);                                         \
  }

WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f32, weaver::F32)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f16, weaver::F16)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_bf16, weaver::BF16)
