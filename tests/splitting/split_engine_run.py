"""One vLLM engine with or without a split plan, for test_split_engine.py (not a test).

Usage: python split_engine_run.py MODEL_DIR '<chunks json or null>' SHM_PREFIX
Prints one JSON line on the real stdout: greedy outputs (token ids) of the prompts, the
worker's split stats, the file the worker imported `weaver` from, and what
weaver_join_pairs reported (cold engines only: this process stands in for a hot engine
whose plan the cold worker serves, so its polls run the real receivers' poll()).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

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
    from weaver.vllm_ext.additional_config import LinkSection, make_additional_config
    from weaver.weaving.plan import PairPlan
    from weaver.weaving.rendezvous import PairFiles

    llm = LLM(model=model_dir, dtype="float32", enforce_eager=True, max_model_len=256,
              max_num_seqs=NUM_PROMPTS, kv_cache_memory_bytes=1 << 26,
              worker_extension_cls="weaver.vllm_ext.worker.WeaverWorkerExtension",
              additional_config=make_additional_config(split_chunks=chunks))
    opened, files = None, None
    if chunks:
        files = PairFiles(Path(tempfile.mkdtemp(prefix=f"{shm_prefix}-pairs-", dir="/dev/shm")))
        plan = PairPlan(hot="h", cold="p", region_name="", shape=HotAttentionShape(**HOT_SHAPE),
                        num_remote_blocks=4, max_seqs_per_task=4, max_blocks_per_seq=2,
                        offload_ratio=0.5, timeout_s=1.0)
        files.publish("p", "hot", {"plan": plan.to_dict(), "model": "h"})
        link = LinkSection("cold", ("p",), str(files.root), lend_bytes=1 << 26, cold_model="c")
        (opened,) = llm.collective_rpc("weaver_join_pairs", args=(link.to_dict(),))
        deadline = time.monotonic() + 60
        while (files.read("p", "cold") or {}).get("status") != "ready":
            assert time.monotonic() < deadline, "the cold worker made no region for the plan"
            time.sleep(0.1)
    prompts = [{"prompt_token_ids": list(range(10 + i, 10 + i + 5 + 3 * i))}
               for i in range(NUM_PROMPTS)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    (stats,) = llm.collective_rpc("weaver_split_stats")
    (info,) = llm.collective_rpc("weaver_info")
    if files is not None:
        llm.collective_rpc("weaver_close")
        shutil.rmtree(files.root, ignore_errors=True)
    protocol.write(json.dumps({"outputs": [list(o) for o in outputs], "stats": stats,
                               "weaver_file": info["weaver_file"], "opened": opened}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
