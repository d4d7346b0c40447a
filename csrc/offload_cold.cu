// Cold side of the CUDA offload transport: the polling kernel (docs/architecture.md, part 4).
//
// Launched on the cold engine's stream after each of its operators. With nothing pending
// (task_seq == done_seq) every block returns after one acquire load. Otherwise the blocks
// run the pending paged decode attention over the remote pool, claiming work items
// (sequence, KV head, chunk of its query heads: paged_attention.cuh) from a counter in
// cold-local scratch memory, and the block that finishes the last item release-stores
// done_seq. With max_spin_ns > 0 the blocks keep polling
// until *stop_flag != 0 or max_spin_ns passes: a persistent "spin-wait" server (on a
// high-priority stream) or the idle poller of an idle cold engine.
//
// Scratch (u64 words, zeroed once by the host, private to the cold process):
//   [0] claim: (task tag << 32) | items claimed  [1] finished: (task tag << 32) | items done
//   [2] seq of the last task that hit a bad block id  [3] number of tasks served
// Tags are the low 32 bits of task_seq; a block holding a stale tag (it read task_seq
// before the task was finished and claims after) compares with serial-number arithmetic
// and backs off, so a block can never count towards the wrong task.
#include "paged_attention.cuh"
#include "offload_region.cuh"

namespace weaver {

enum ScratchIndex : int { kScratchClaim = 0, kScratchFinished = 1, kScratchFailedSeq = 2, kScratchServed = 3 };

// Returns the claimed item index, or -1 when the task has no items left or is stale.
__device__ int claim_item(u64* word, u32 tag, int num_items) {
  u64 current = atomicAdd(word, 0ULL);
  while (true) {
    const u32 current_tag = static_cast<u32>(current >> 32);
    const u32 count = static_cast<u32>(current);
    u64 next;
    int index;
    if (current_tag == tag) {
      if (count >= static_cast<u32>(num_items)) return -1;
      next = current + 1;
      index = static_cast<int>(count);
    } else if (static_cast<int>(tag - current_tag) > 0) {
      next = (static_cast<u64>(tag) << 32) | 1ULL;  // first claim of a newer task
      index = 0;
    } else {
      return -1;  // our view of the task is stale
    }
    const u64 previous = atomicCAS(word, current, next);
    if (previous == current) return index;
    current = previous;
  }
}

// Counts one finished item of task `tag`; returns the number finished so far.
__device__ u32 finish_item(u64* word, u32 tag) {
  u64 current = atomicAdd(word, 0ULL);
  while (true) {
    const bool is_same = static_cast<u32>(current >> 32) == tag;
    const u64 next = is_same ? current + 1 : (static_cast<u64>(tag) << 32) | 1ULL;
    const u64 previous = atomicCAS(word, current, next);
    if (previous == current) return static_cast<u32>(next);
    current = previous;
  }
}

template <class Dt, int kVecs>
__device__ void poll_and_attend(unsigned char* region, const i64* desc, u64* scratch,
                                const int* stop_flag, u64 max_spin_ns) {
  __shared__ AttnShared shared;
  __shared__ i64 pending_seq;
  __shared__ int claimed;
  const i64* task_seq = region_ptr<i64>(region, desc, kDescTaskSeq);
  i64* done_seq = region_ptr<i64>(region, desc, kDescDoneSeq);
  const u64 start = max_spin_ns > 0 ? globaltimer_ns() : 0;
  while (true) {
    // Thread 0 decides for the whole block (a per-thread read of the stop flag or the
    // clock could split the block at the barriers below): -1 return, 0 idle, else serve.
    if (threadIdx.x == 0) {
      const i64 task = ld_acquire_sys(task_seq);
      const i64 done = ld_relaxed_sys(done_seq);
      i64 decision = task > done ? task : 0;
      if (decision == 0) {
        const bool is_stopped = max_spin_ns == 0 ||
                                *reinterpret_cast<const volatile int*>(stop_flag) != 0 ||
                                globaltimer_ns() - start > max_spin_ns;
        if (is_stopped) {
          decision = -1;
        } else {
          backoff_ns(100);
        }
      }
      pending_seq = decision;
    }
    __syncthreads();
    const i64 seq = pending_seq;
    __syncthreads();  // pending_seq is rewritten on the next round
    if (seq < 0) return;  // the common case after every cold operator: nothing pending
    if (seq == 0) continue;
    const i64* meta = region_ptr<const i64>(region, desc, kDescMetaInts);
    const double* meta_floats = region_ptr<const double>(region, desc, kDescMetaFloats);
    const i64 layer = meta[kMetaLayer];
    const i64 num_seqs = meta[kMetaNumSeqs];
    const bool is_valid = meta[kMetaTaskSeq] == seq && layer >= 0 &&
                          layer < desc[kDescNumLayers] && num_seqs >= 1 &&
                          num_seqs <= desc[kDescMaxSeqs];
    AttnParams p;
    p.q = region + desc[kDescQ];
    p.kv = region + desc[kDescKv] + layer * desc[kDescKvLayerBytes];
    p.seq_lens = region_ptr<const int>(region, desc, kDescSeqLens);
    p.block_table = region_ptr<const int>(region, desc, kDescBlockTable);
    p.out = region + desc[kDescOut];
    p.num_seqs = static_cast<int>(num_seqs);
    p.num_q_heads = static_cast<int>(desc[kDescNumQHeads]);
    p.num_kv_heads = static_cast<int>(desc[kDescNumKvHeads]);
    p.head_size = static_cast<int>(desc[kDescHeadSize]);
    p.block_size = static_cast<int>(desc[kDescBlockSize]);
    p.block_table_stride = static_cast<int>(desc[kDescMaxBlocks]);
    p.num_blocks = static_cast<int>(desc[kDescNumBlocks]);
    p.sliding_window = static_cast<int>(meta[kMetaSlidingWindow]);
    p.scale = static_cast<float>(meta_floats[kMetaScale]);
    p.softcap = static_cast<float>(meta_floats[kMetaSoftcap]);
    p.kv_format = static_cast<int>(desc[kDescKvFormat]);
    // An invalid task is one item of no work that completes with kResultFailed.
    const int num_items = is_valid ? num_attention_items(p) : 1;
    const u32 tag = static_cast<u32>(seq);
    while (true) {
      if (threadIdx.x == 0) claimed = claim_item(&scratch[kScratchClaim], tag, num_items);
      __syncthreads();
      const int item = claimed;
      __syncthreads();
      if (item < 0) break;
      bool is_ok = is_valid;
      if (is_valid) is_ok = attend_item<Dt, kVecs>(p, item, shared);  // ends with __syncthreads
      if (threadIdx.x == 0) {
        if (!is_ok) atomicExch(&scratch[kScratchFailedSeq], static_cast<u64>(seq));
        // Our output stores (made visible to thread 0 by the barrier in attend_item) must
        // be visible system-wide before the item counts as finished.
        __threadfence_system();
        const u32 num_finished = finish_item(&scratch[kScratchFinished], tag);
        if (num_finished == static_cast<u32>(num_items)) {
          __threadfence_system();  // every block's outputs before the completion
          const bool has_failed = atomicAdd(&scratch[kScratchFailedSeq], 0ULL) == static_cast<u64>(seq);
          st_relaxed_sys(region_ptr<i64>(region, desc, kDescDoneResult),
                         has_failed ? kResultFailed : kResultOk);
          st_release_sys(done_seq, seq);  // the LAST store of the task
          atomicAdd(&scratch[kScratchServed], 1ULL);
        }
      }
    }
    if (max_spin_ns == 0) return;  // served what we could; the next poll serves the rest
    if (threadIdx.x == 0) backoff_ns(100);  // all claimed: others are finishing the task
  }
}

}  // namespace weaver

#define WEAVER_POLL_KERNEL(NAME, DT, VECS)                                                      \
  extern "C" __global__ void __launch_bounds__(weaver::kThreads)                          \
      NAME(unsigned char* region, const long long* desc, unsigned long long* scratch,     \
           const int* stop_flag, unsigned long long max_spin_ns) {                        \
    weaver::poll_and_attend<DT, VECS>(region, desc, scratch, stop_flag, max_spin_ns);           \
  }

WEAVER_POLL_KERNEL(weaver_poll_and_attend_f32_h128, weaver::F32, 1)
WEAVER_POLL_KERNEL(weaver_poll_and_attend_f16_h128, weaver::F16, 1)
WEAVER_POLL_KERNEL(weaver_poll_and_attend_bf16_h128, weaver::BF16, 1)
WEAVER_POLL_KERNEL(weaver_poll_and_attend_f32_h256, weaver::F32, 2)
WEAVER_POLL_KERNEL(weaver_poll_and_attend_f16_h256, weaver::F16, 1)
WEAVER_POLL_KERNEL(weaver_poll_and_attend_bf16_h256, weaver::BF16, 1)
