// Hot side of the CUDA offload transport: publish a task and wait for its completion,
// both from the hot engine's own stream so the CPU never synchronises (docs/architecture.md,
// part 4). Launched with one thread by weaver/offload/cuda/kernels.py.
#include "offload_region.cuh"

// Writes the task metadata, then release-stores task_seq. The q / seq_lens / block_table
// copies into the region were enqueued before this kernel on the same stream, so they
// are complete when it starts; the system-scope fence orders them (fence cumulativity)
// and the metadata before the counter for an observer on another device or process.
extern "C" __global__ void weaver_publish(unsigned char* region, const long long* desc,
                                          long long seq, long long layer, long long num_seqs,
                                          long long sliding_window, double scale,
                                          double softcap, unsigned long long* stamp) {
  using namespace weaver;
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  i64* meta = region_ptr<i64>(region, desc, kDescMetaInts);
  double* meta_floats = region_ptr<double>(region, desc, kDescMetaFloats);
  meta[kMetaLayer] = layer;
  meta[kMetaNumSeqs] = num_seqs;
  meta[kMetaSlidingWindow] = sliding_window;
  meta_floats[kMetaScale] = scale;
  meta_floats[kMetaSoftcap] = softcap;
  meta[kMetaTaskSeq] = seq;
  __threadfence_system();
  st_release_sys(region_ptr<i64>(region, desc, kDescTaskSeq), seq);
  if (stamp != nullptr) *stamp = globaltimer_ns();
}

// Spins until done_seq >= seq (acquire), the cold side closes, or timeout_ns passes; then
// writes a WaitStatus to status[0] and the number of polls to status[1]. It never hangs:
// the timeout is measured with %globaltimer. The kernels after it on the stream read the
// output staging only if status[0] == kWaitOk (the hot side checks it, or selects the
// local fallback, from the host after its next sync).
extern "C" __global__ void weaver_wait_done(unsigned char* region, const long long* desc,
                                            long long seq, unsigned long long timeout_ns,
                                            unsigned int backoff_ns_per_poll, int* status,
                                            unsigned long long* stamp) {
  using namespace weaver;
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  const i64* done_seq = region_ptr<i64>(region, desc, kDescDoneSeq);
  const i64* region_status = region_ptr<i64>(region, desc, kDescStatus);
  const u64 start = globaltimer_ns();
  int outcome = kWaitPending;
  int num_polls = 0;
  while (outcome == kWaitPending) {
    ++num_polls;
    const i64 done = ld_acquire_sys(done_seq);
    if (done >= seq) {
      const i64 result = ld_relaxed_sys(region_ptr<i64>(region, desc, kDescDoneResult));
      if (done != seq) {
        outcome = kWaitProtocolError;
      } else {
        outcome = result == kResultOk ? kWaitOk : kWaitFailed;
      }
    } else if (ld_relaxed_sys(region_status) >= kStatusClosing) {
      outcome = kWaitClosed;
    } else if (globaltimer_ns() - start > timeout_ns) {
      outcome = kWaitTimeout;
    } else if (backoff_ns_per_poll > 0) {
      backoff_ns(backoff_ns_per_poll);
    }
  }
  status[0] = outcome;
  status[1] = num_polls;
  if (stamp != nullptr) *stamp = globaltimer_ns();
}
