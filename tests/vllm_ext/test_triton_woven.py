"""A GPU attention backend through Weaver's weaving wrapper: vLLM's TRITON_ATTN (its builder,
impl, K/V write and kernel) behind weaver/vllm_ext/attention/gpu_backends.py, run on this
CPU by Triton's interpreter (tests/vllm_ext/triton_interpreter.py says what that takes).

One woven step mixes local decode and prefill, remote decode (offloaded through a real
shared-memory region to a cold process that answers with vLLM's Triton kernel over the
region's "token"-format KV) and remote prefill (attended on the hot side over the region),
a chunked prefill continuing over earlier chunks included, under a sliding window shorter
than the longest sequences. It must give the rows of the same batch unsplit through vLLM's
own TRITON_ATTN over one cache holding every block (which a torch oracle checks in turn),
and the remote decode rows must really have been served by the cold process: a silent
fallback to the hot side gives the same rows.

Both sides run in processes of their own (TRITON_INTERPRET=1 and the interpreter's changes
to vLLM stay out of pytest's process; the interpreter is not thread-safe, so the cold side
cannot be a thread beside the hot one).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from triton_woven_run import (
    BLOCK_SIZE,
    HEAD_SIZE,
    NUM_HEADS,
    NUM_KV_HEADS,
    STEP,
)

from weaver.offload.layout import HotAttentionShape
from weaver.offload.naming import DEFAULT_SHM_DIR, region_name, region_paths
from weaver.weaving.plan import PairPlan

pytest.importorskip("triton")

REPO = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).with_name("triton_woven_run.py")
TIMEOUT_S = 300
ATOL = 1e-5  # float32; the split only changes which kernel launch computes a row


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}


@pytest.fixture(scope="module")
def plan() -> PairPlan:
    return PairPlan(
        hot="hot", cold="cold",
        region_name=region_name(f"wvtest{os.getpid()}", "triton", uuid.uuid4().hex[:8]),
        shape=HotAttentionShape(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, "float32",
                                kv_format="token"),
        num_remote_blocks=16, max_seqs_per_task=4, max_blocks_per_seq=4, offload_ratio=0.5,
        # The interpreter takes seconds per task: a wait must not time out into a fallback.
        timeout_s=float(TIMEOUT_S))


@pytest.fixture(scope="module")
def run(plan) -> dict:
    """The cold process first (its imports overlap the hot one's), then the hot step; the
    cold process's own count of what it served comes back with the hot side's JSON."""
    plan_json = json.dumps(plan.to_dict())
    cold = subprocess.Popen([sys.executable, str(RUNNER), "cold", plan_json], cwd=REPO,
                            env=_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ready = cold.stdout.readline().strip()
        assert ready == "READY", f"cold side did not start: {ready!r}"
        hot = subprocess.run([sys.executable, str(RUNNER), "hot", plan_json], cwd=REPO,
                             env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S)
        closed, _ = cold.communicate("close\n", timeout=60)
    finally:
        if cold.poll() is None:
            cold.kill()
            cold.wait()
        leftovers = [p for p in region_paths(plan.region_name, DEFAULT_SHM_DIR)
                     if os.path.exists(p)]
        for path in leftovers:
            os.unlink(path)
    assert hot.returncode == 0, hot.stderr[-6000:]
    assert not leftovers, f"the region was left behind: {leftovers}"
    result = json.loads(hot.stdout.strip().splitlines()[-1])
    result["cold"] = dict(word.split("=") for word in closed.split()[1:])
    return result


def test_triton_attn_resolves_to_weavers_class_lazily(run):
    assert run["backend_path"] == ("weaver.vllm_ext.attention.gpu_backends."
                                   "WeaverTritonAttentionBackend")
    assert run["backend_name"] == "TRITON_ATTN" and run["is_triton_backend"]
    # Importing gpu_backends imported none of the other GPU backends' vLLM modules.
    assert run["gpu_backend_modules_preloaded"] == []


def test_the_step_is_split_by_placement(run):
    assert run["metadata"] == "WovenMetadata"
    assert run["groups"] == {
        "local": [s for q, s, remote in STEP if not remote],
        "remote_prefill": [s for q, s, remote in STEP if remote and q > 1],
        "remote_decode": [s for q, s, remote in STEP if remote and q == 1],
    }
    assert run["hot"]["remote_sequences"] == 1  # the remote prompt's first chunk
    assert run["hot"]["remote_prefill_rows"] == 2


def test_new_kv_goes_to_the_local_cache_or_the_region(run):
    """Weaver's K/V routing through TRITON_ATTN's own write: the engine's cache and the
    region's KV section hold exactly the blocks of one unsplit cache."""
    assert run["local_kv_equal"] and run["region_kv_equal"]


def test_remote_decode_rows_were_served_by_the_cold_process(run):
    num_remote_decode = sum(1 for q, _, remote in STEP if remote and q == 1)
    assert run["hot"]["offloaded_tasks"] == 1  # one layer, one task
    assert run["hot"]["offloaded_rows"] == num_remote_decode
    assert run["hot"]["fallback_tasks"] == 0 and run["hot"]["degraded_reason"] is None
    assert run["sender"]["num_completed"] == 1 and run["sender"]["num_failed"] == 0
    assert run["cold"] == {"served": "1", "failed": "0"}


def test_a_woven_step_gives_the_rows_of_the_unsplit_batch(run):
    assert run["max_err_plain_vs_oracle"] < 1e-4  # vLLM's kernel under the interpreter
    assert run["max_err_woven_vs_plain"] <= ATOL


def test_gpu_backends_wrap_the_classes_vllms_registry_names():
    """Checked without importing any GPU backend: a vLLM that moved one fails here rather
    than when an engine first asks for it."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    from weaver.vllm_ext.attention import gpu_backends

    for name, (_, platform_path) in gpu_backends._PLATFORM_BACKENDS.items():
        assert AttentionBackendEnum[name].value == platform_path


def test_the_plugin_puts_the_wrapper_in_front_of_a_cuda_platforms_backends():
    """What register() does in an engine on a GPU (plugin.py), with a platform that says
    it is CUDA: vLLM's registry then resolves each backend to Weaver's class. The
    registry's overrides are put back afterwards (they are process-wide)."""
    from vllm.v1.attention.backends.registry import _ATTN_OVERRIDES, AttentionBackendEnum

    from weaver.vllm_ext.attention.gpu_backends import WOVEN_BACKEND_PATHS
    from weaver.vllm_ext.plugin import register_woven_backends

    class CudaPlatform:  # the platform's two answers the plugin reads, nothing else
        def is_cpu(self) -> bool:
            return False

        def is_cuda(self) -> bool:
            return True

    saved = dict(_ATTN_OVERRIDES)
    try:
        assert register_woven_backends(CudaPlatform()) == ["FLASHINFER", "FLASH_ATTN",
                                                           "TRITON_ATTN"]
        assert AttentionBackendEnum.TRITON_ATTN.get_path() == WOVEN_BACKEND_PATHS["TRITON_ATTN"]
        backend = AttentionBackendEnum.TRITON_ATTN.get_class()
        assert backend.get_name() == "TRITON_ATTN"  # still vLLM's backend to vLLM
        assert "Woven" in " ".join(c.__name__ for c in backend.get_impl_cls().__mro__)
    finally:
        _ATTN_OVERRIDES.clear()
        _ATTN_OVERRIDES.update(saved)
