"""One vLLM engine with or without a split plan, for test_split_engine.py (not a test).

Usage: python split_engine_run.py MODEL_DIR '<chunks json or null>' SHM_PREFIX
Prints one JSON line on the real stdout: greedy outputs (token ids) of the prompts, the
worker's split stats, the file the worker imported `weaver` from, and what
weaver_open_cold reported (cold engines only).
"""

from __future__ import annotations

import json
import os
import sys

NUM_PROMPTS = 8
MAX_TOKENS = 16
# A small hot shape for the region the cold worker opens (its polls then run the real
# receivers' poll(), with nothing pending).
HOT_SHAPE = {"num_layers": 2, "num_q_heads": 4, "num_kv_heads": 2, "head_size": 32,
             "block_size": 32, "dtype": "float32"}


def main() -> int:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    model_dir, chunks_json, shm_prefix = sys.argv[1:4]
    chunks = json.loads(chunks_json)

    from vllm import LLM, SamplingParams

    from weaver.offload.layout import HotAttentionShape
    from weaver.offload.naming import region_name
    from weaver.vllm_ext.additional_config import make_additional_config
    from weaver.weaving.plan import PairPlan

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=1 << 26,
              worker_extension_cls="weaver.vllm_ext.worker.WeaverWorkerExtension",
              additional_config=make_additional_config(split_chunks=chunks))
    opened = None
    if chunks:
        plan = PairPlan(hot="h", cold="c", region_name=region_name(shm_prefix, "h", "c"),
                        shape=HotAttentionShape(**HOT_SHAPE), num_remote_blocks=4,
                        max_seqs_per_task=4, max_blocks_per_seq=2, offload_ratio=0.5,
                        timeout_s=1.0)
        (opened,) = llm.collective_rpc("weaver_open_cold", args=([plan.to_dict()],))
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 5 + 3 * i))}
               for i in range(NUM_PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    (stats,) = llm.collective_rpc("weaver_split_stats")
    (info,) = llm.collective_rpc("weaver_info")
    if chunks:
        llm.collective_rpc("weaver_close")
    protocol.write(json.dumps({"outputs": [list(o) for o in outputs], "stats": stats,
                               "weaver_file": info["weaver_file"], "opened": opened}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
