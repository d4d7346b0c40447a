// The offload region as device code sees it: a byte base pointer plus a descriptor of
// int64 words built on the host from weaver.offload.layout.RegionLayout by
// weaver/offload/cuda/region_desc.py (the index order below must match DESC_FIELDS
// there; tests/gpu/test_region_desc.py checks it by parsing this file).
#pragma once

#include "weaver_common.cuh"

namespace weaver {

enum DescIndex : int {
  kDescTaskSeq = 0,       // byte offset of task_seq (int64, written by hot)
  kDescDoneSeq = 1,       // byte offset of done_seq (int64, written by cold)
  kDescDoneResult = 2,    // byte offset of done_result (int64 TaskResult)
  kDescStatus = 3,        // byte offset of the cold side's RegionStatus word
  kDescMetaInts = 4,      // byte offset of the int64 task metadata
  kDescMetaFloats = 5,    // byte offset of the float64 task metadata
  kDescSeqLens = 6,       // byte offset of int32 seq_lens [max_seqs]
  kDescBlockTable = 7,    // byte offset of int32 block_table [max_seqs, max_blocks]
  kDescQ = 8,             // byte offset of q staging
  kDescOut = 9,           // byte offset of output staging
  kDescKv = 10,           // byte offset of layer 0's KV pool
  kDescKvLayerBytes = 11, // bytes per layer of the KV pool
  kDescNumLayers = 12,
  kDescNumQHeads = 13,
  kDescNumKvHeads = 14,
  kDescHeadSize = 15,
  kDescBlockSize = 16,
  kDescMaxSeqs = 17,
  kDescMaxBlocks = 18,
  kDescNumBlocks = 19,
  kDescKvFormat = 20,     // 0: "pages", 1: "token" (layout.KV_FORMATS)
  kDescNumWords = 21,
};

// Task metadata words (weaver/offload/layout.py META_*).
enum MetaInt : int { kMetaTaskSeq = 0, kMetaLayer = 1, kMetaNumSeqs = 2, kMetaSlidingWindow = 3 };
enum MetaFloat : int { kMetaScale = 0, kMetaSoftcap = 1 };

// weaver.offload.layout.TaskResult / RegionStatus
enum : i64 { kResultOk = 0, kResultFailed = 1 };
enum : i64 { kStatusInitializing = 0, kStatusAlive = 1, kStatusClosing = 2, kStatusClosed = 3 };

// Outcome of a device-side wait, written to the hot side's status word
// (weaver/offload/protocol.py WaitStatus; its DEAD is seen from the host only).
enum WaitStatus : int {
  kWaitPending = 0,
  kWaitOk = 1,
  kWaitFailed = 2,
  kWaitTimeout = 3,
  kWaitClosed = 4,
  kWaitProtocolError = 5,
};

template <class T>
__device__ __forceinline__ T* region_ptr(unsigned char* base, const i64* desc, int index) {
  return reinterpret_cast<T*>(base + desc[index]);
}

}  // namespace weaver
