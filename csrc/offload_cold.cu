// Cold side of the CUDA offload transport (docs/architecture.md, part 4): two servers over
// the same region protocol and scratch.
//
// The armed server (weaver_watch + weaver_attend_armed, queued in pairs on a high-priority
// stream by weaver/offload/cuda/armed_server.py): a one-thread watch spins (bounded by
// max_spin_ns) until a task is pending and leaves its seq in scratch; the attend kernel
// after it on the same stream serves exactly that seq with its whole grid, so every block
// that serves a task knows it (the poll kernel's blocks each read the counters once, and
// the one that read after the publish served a whole task alone: the 7 ms tail seen on an
// H100 and an H200). A task of few sequences is split along the context into spans
// (FlashDecoding), each span's softmax state merged by the block that finishes the
// item's last span. An idle cold step pays one warp on one SM, not a launch per operator.
//
// The polling kernel, launched on the cold engine's stream after each of its operators. With nothing pending
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
//   [4] seq the last watch found pending (0: none), read by the attend kernel after it
// Tags are the low 32 bits of task_seq; a block holding a stale tag (it read task_seq
// before the task was finished and claims after) compares with serial-number arithmetic
// and backs off, so a block can never count towards the wrong task.
#include "paged_attention.cuh"
#include "offload_region.cuh"

namespace weaver {

enum ScratchIndex : int {
  kScratchClaim = 0,
  kScratchFinished = 1,
  kScratchFailedSeq = 2,
  kScratchServed = 3,
  kScratchArmed = 4,
  kScratchWords = 8,  // weaver/offload/cuda/transport.py SCRATCH_WORDS
};

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

// The parameters of task `seq` from the region; false if its metadata is not seq's or
// is out of range (the task then completes as one failed item of no work).
__device__ bool task_params(unsigned char* region, const i64* desc, i64 seq, AttnParams& p) {
  const i64* meta = region_ptr<const i64>(region, desc, kDescMetaInts);
  const double* meta_floats = region_ptr<const double>(region, desc, kDescMetaFloats);
  const i64 layer = meta[kMetaLayer];
  const i64 num_seqs = meta[kMetaNumSeqs];
  const bool is_valid = meta[kMetaTaskSeq] == seq && layer >= 0 &&
                        layer < desc[kDescNumLayers] && num_seqs >= 1 &&
                        num_seqs <= desc[kDescMaxSeqs];
  p.q = region + desc[kDescQ];
  p.kv = region + desc[kDescKv] + (is_valid ? layer : 0) * desc[kDescKvLayerBytes];
  p.seq_lens = region_ptr<const int>(region, desc, kDescSeqLens);
  p.block_table = region_ptr<const int>(region, desc, kDescBlockTable);
  p.out = region + desc[kDescOut];
  p.num_seqs = is_valid ? static_cast<int>(num_seqs) : 0;
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
  return is_valid;
}

// Publishes task seq's completion: called once, by thread 0 of the block that counted its
// last item, after that block's outputs are fenced.
__device__ void complete_task(unsigned char* region, const i64* desc, u64* scratch, i64 seq) {
  __threadfence_system();  // every block's outputs before the completion
  const bool has_failed = atomicAdd(&scratch[kScratchFailedSeq], 0ULL) == static_cast<u64>(seq);
  st_relaxed_sys(region_ptr<i64>(region, desc, kDescDoneResult), has_failed ? kResultFailed : kResultOk);
  st_release_sys(region_ptr<i64>(region, desc, kDescDoneSeq), seq);  // the LAST store of the task
  atomicAdd(&scratch[kScratchServed], 1ULL);
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
    AttnParams p;
    const bool is_valid = task_params(region, desc, seq, p);
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
        if (num_finished == static_cast<u32>(num_items)) complete_task(region, desc, scratch, seq);
      }
    }
    if (max_spin_ns == 0) return;  // served what we could; the next poll serves the rest
    if (threadIdx.x == 0) backoff_ns(100);  // all claimed: others are finishing the task
  }
}

// The armed server's watch: one thread spins until a task is pending (task_seq >
// done_seq), *stop_flag != 0 or max_spin_ns passes, then leaves the pending seq (or 0) in
// scratch[kScratchArmed] for the attend kernel queued after it. Bounded: a watch never
// outlives max_spin_ns, so the cold process's own synchronisation waits at most that.
__device__ void watch(unsigned char* region, const i64* desc, u64* scratch, const int* stop_flag,
                      u64 max_spin_ns, u32 backoff) {
  const i64* task_seq = region_ptr<i64>(region, desc, kDescTaskSeq);
  const i64* done_seq = region_ptr<i64>(region, desc, kDescDoneSeq);
  const u64 start = globaltimer_ns();
  i64 found = 0;
  while (true) {
    const i64 task = ld_acquire_sys(task_seq);
    if (task > ld_relaxed_sys(done_seq)) {
      found = task;
      break;
    }
    if (*reinterpret_cast<const volatile int*>(stop_flag) != 0 || globaltimer_ns() - start > max_spin_ns)
      break;
    if (backoff > 0) backoff_ns(backoff);
  }
  // Plain store: the attend kernel runs after this kernel on the same stream.
  scratch[kScratchArmed] = static_cast<u64>(found);
}

// The number of spans each item of the armed task is split into: enough to give every
// block of the grid work when the task has few items, no more spans than the longest
// sequence has span_tokens chunks, and items * spans within max_units (the partial
// buffer's capacity). Block-uniform: every block computes it from the same task data.
__device__ int num_spans_of(const AttnParams& p, int num_items, int span_tokens, int max_units) {
  __shared__ int longest;
  if (threadIdx.x == 0) longest = 0;
  __syncthreads();
  int local = 0;
  for (int s = threadIdx.x; s < p.num_seqs; s += blockDim.x) local = max(local, p.seq_lens[s]);
  atomicMax(&longest, local);
  __syncthreads();
  const int by_length = max(1, (longest + span_tokens - 1) / span_tokens);
  const int by_grid = max(1, static_cast<int>(gridDim.x) / max(1, num_items));
  const int spans = min(min(by_length, by_grid), max_units / max(1, num_items));
  __syncthreads();  // longest is rewritten by the next call
  return max(1, spans);
}

// The armed server's attend: serves exactly the seq the watch before it armed (nothing if
// none, or if it is done already), its work units claimed dynamically by the grid. A unit
// is an item (num_spans == 1: the output written directly) or one span of an item; the
// block that counts an item's last span merges its spans. partial: [max_units *
// partial_floats] floats, item i's spans at units [i * num_spans, (i + 1) * num_spans);
// span_count: [max_units] u32, zero between tasks (the merging block resets its item's).
template <class Dt, int kVecs>
__device__ void attend_armed(unsigned char* region, const i64* desc, u64* scratch, float* partial,
                             u32* span_count, int max_units, int span_tokens) {
  __shared__ AttnShared shared;
  __shared__ i64 armed;
  __shared__ int claimed;
  __shared__ int is_last;
  __shared__ int has_failed;
  if (threadIdx.x == 0) {
    i64 seq = static_cast<i64>(scratch[kScratchArmed]);
    if (seq > 0 && ld_acquire_sys(region_ptr<i64>(region, desc, kDescDoneSeq)) >= seq) seq = 0;
    armed = seq;
  }
  __syncthreads();
  const i64 seq = armed;
  if (seq <= 0) return;  // block-uniform
  AttnParams p;
  const bool is_valid = task_params(region, desc, seq, p);
  const int num_items = is_valid ? num_attention_items(p) : 1;
  const int num_spans = is_valid ? num_spans_of(p, num_items, span_tokens, max_units) : 1;
  const int num_units = num_items * num_spans;
  const int span_floats = partial_floats(p);
  const u32 tag = static_cast<u32>(seq);
  while (true) {
    if (threadIdx.x == 0) claimed = claim_item(&scratch[kScratchClaim], tag, num_units);
    __syncthreads();
    const int unit = claimed;
    __syncthreads();
    if (unit < 0) break;
    // span-major: the first units claimed spread over the items
    const int span = unit / num_items;
    const int item = unit - span * num_items;
    bool is_ok = is_valid;
    bool is_item_done = true;
    if (is_valid && num_spans == 1) {
      is_ok = attend_item<Dt, kVecs>(p, item, shared);
    } else if (is_valid) {
      float* spans = partial + static_cast<i64>(item) * num_spans * span_floats;
      is_ok = attend_span<Dt, kVecs>(p, item, span * span_tokens, (span + 1) * span_tokens, shared,
                                     spans + static_cast<i64>(span) * span_floats);
      if (threadIdx.x == 0) {
        if (!is_ok) atomicExch(&scratch[kScratchFailedSeq], static_cast<u64>(seq));
        __threadfence();  // this span's state before it counts
        is_last = atomicAdd(&span_count[item], 1u) + 1u == static_cast<u32>(num_spans);
        if (is_last) {
          __threadfence();  // the other spans' states before they are read
          has_failed = atomicAdd(&scratch[kScratchFailedSeq], 0ULL) == static_cast<u64>(seq);
        }
      }
      __syncthreads();
      is_item_done = is_last != 0;
      if (is_item_done) {
        merge_spans<Dt>(p, item, num_spans, spans, has_failed == 0);
        is_ok = has_failed == 0;
        __syncthreads();
        if (threadIdx.x == 0) atomicExch(&span_count[item], 0u);
      }
    }
    if (threadIdx.x == 0 && is_item_done) {
      if (!is_ok) atomicExch(&scratch[kScratchFailedSeq], static_cast<u64>(seq));
      __threadfence_system();  // this item's output before it counts
      if (finish_item(&scratch[kScratchFinished], tag) == static_cast<u32>(num_items))
        complete_task(region, desc, scratch, seq);
    }
    __syncthreads();  // is_last / has_failed are rewritten by the next unit
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

extern "C" __global__ void weaver_watch(unsigned char* region, const long long* desc,
                                        unsigned long long* scratch, const int* stop_flag,
                                        unsigned long long max_spin_ns, unsigned int backoff) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  weaver::watch(region, desc, scratch, stop_flag, max_spin_ns, backoff);
}

#define WEAVER_ARMED_KERNEL(NAME, DT, VECS)                                                     \
  extern "C" __global__ void __launch_bounds__(weaver::kThreads)                                \
      NAME(unsigned char* region, const long long* desc, unsigned long long* scratch,           \
           float* partial, unsigned int* span_count, int max_units, int span_tokens) {           \
    weaver::attend_armed<DT, VECS>(region, desc, scratch, partial, span_count, max_units,        \
                                   span_tokens);                                                  \
  }

WEAVER_ARMED_KERNEL(weaver_attend_armed_f32_h128, weaver::F32, 1)
WEAVER_ARMED_KERNEL(weaver_attend_armed_f16_h128, weaver::F16, 1)
WEAVER_ARMED_KERNEL(weaver_attend_armed_bf16_h128, weaver::BF16, 1)
WEAVER_ARMED_KERNEL(weaver_attend_armed_f32_h256, weaver::F32, 2)
WEAVER_ARMED_KERNEL(weaver_attend_armed_f16_h256, weaver::F16, 1)
WEAVER_ARMED_KERNEL(weaver_attend_armed_bf16_h256, weaver::BF16, 1)
