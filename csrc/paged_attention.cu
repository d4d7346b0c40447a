// Standalone paged decode attention (same math as the polling kernel's): one thread block
// of weaver::kThreads threads per work item (sequence, KV head, chunk of its query heads:
// paged_attention.cuh); grid-stride over items so any grid size is correct. Launched by
// weaver/offload/cuda/kernels.py.
//
// The _if_failed variants are the hot side's fallback without a host synchronisation:
// enqueued on the hot stream right after a device wait (offload_hot.cu weaver_wait_done),
// they return at once when that wait ended OK and otherwise attend the task's rows on the
// hot device (over the peer-mapped region) and count one fallback, which the host reads
// once per step.
#include "offload_region.cuh"
#include "paged_attention.cuh"

namespace weaver {

template <class Dt, int kVecs>
__device__ void paged_decode_attention(const AttnParams& p, int* error_flag) {
  __shared__ AttnShared shared;
  const int num_items = num_attention_items(p);
  for (int item = blockIdx.x; item < num_items; item += gridDim.x) {
    const bool is_ok = attend_item<Dt, kVecs>(p, item, shared);
    if (!is_ok && threadIdx.x == 0 && error_flag != nullptr) atomicExch(error_flag, 1);
  }
}

}  // namespace weaver

// The standalone kernels' parameters (both variants take them first) and the AttnParams
// they make: kernels.py passes them in this order.
#define WEAVER_ATTENTION_PARAMS                                                                \
  const void *q, const void *kv, const int *seq_lens, const int *block_table, void *out,      \
      int num_seqs, int num_q_heads, int num_kv_heads, int head_size, int block_size,          \
      int block_table_stride, int num_blocks, int sliding_window, float scale, float softcap,  \
      int kv_format, int *error_flag
#define WEAVER_ATTENTION_STRUCT                                                                \
  weaver::AttnParams {                                                                         \
    q, kv, seq_lens, block_table, out, num_seqs, num_q_heads, num_kv_heads, head_size,         \
        block_size, block_table_stride, num_blocks, sliding_window, scale, softcap, kv_format  \
  }

// Two resident blocks per SM (at most 128 registers a thread) for rows of one 16-byte
// vector per lane: a task of more items than SMs then keeps 16 warps per SM in flight,
// not 8. On an H100 (benchmarks/attention_kernel.py) a 64-sequence Llama-3-8B task went
// from 1,093-1,101 to 678-688 us at 4,096 tokens, the device copy's read rate, for 8-16
// bytes of spill; a 16-sequence task (one item per SM) stayed within noise. Rows of two
// vectors per lane (fp32, head size over 128) keep one block per SM: at 128 registers
// they spill 168 bytes. The polling kernel (offload_cold.cu) keeps one block per SM too:
// its grid is one block per SM.
#define WEAVER_MIN_BLOCKS_PER_SM(VECS) (2 / (VECS))

#define WEAVER_ATTENTION_KERNEL(NAME, DT, VECS)                                               \
  extern "C" __global__ void __launch_bounds__(weaver::kThreads, WEAVER_MIN_BLOCKS_PER_SM(VECS))   \
      NAME(WEAVER_ATTENTION_PARAMS) {                                                          \
    weaver::paged_decode_attention<DT, VECS>(WEAVER_ATTENTION_STRUCT, error_flag);            \
  }

#define WEAVER_FALLBACK_KERNEL(NAME, DT, VECS)                                                \
  extern "C" __global__ void __launch_bounds__(weaver::kThreads, WEAVER_MIN_BLOCKS_PER_SM(VECS))   \
      NAME(WEAVER_ATTENTION_PARAMS, const int *wait_status, unsigned long long *num_fallbacks) { \
    if (wait_status[0] == weaver::kWaitOk) return;                                             \
    if (blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(num_fallbacks, 1ULL);                   \
    weaver::paged_decode_attention<DT, VECS>(WEAVER_ATTENTION_STRUCT, error_flag);            \
  }

// One kernel per dtype and head-size bound: _h128 for head_size <= 128, _h256 for <= 256
// (kernels.py picks by head size). The last argument is the 16-byte vectors per lane of a
// row: a 256-element fp16/bf16 row is 32 vectors, one per lane, an fp32 one 64. Names are
// spelled out: tests/gpu/test_region_desc.py finds every kernel the wrappers launch here.
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f32_h128, weaver::F32, 1)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f16_h128, weaver::F16, 1)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_bf16_h128, weaver::BF16, 1)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f32_h256, weaver::F32, 2)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_f16_h256, weaver::F16, 1)
WEAVER_ATTENTION_KERNEL(weaver_paged_attention_bf16_h256, weaver::BF16, 1)

WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_f32_h128, weaver::F32, 1)
WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_f16_h128, weaver::F16, 1)
WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_bf16_h128, weaver::BF16, 1)
WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_f32_h256, weaver::F32, 2)
WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_f16_h256, weaver::F16, 1)
WEAVER_FALLBACK_KERNEL(weaver_paged_attention_if_failed_bf16_h256, weaver::BF16, 1)
