"""The `weaver` block of a plain `vllm serve` (weaver/vllm_ext/plugin_pairs.py): checked,
and turned into the hooks and plan a weaving engine needs by vLLM's own config building
(the plugin's patch of EngineArgs.create_engine_config, patches/engine_config_hook.py)."""

from __future__ import annotations

import os

import pytest

from weaver.vllm_ext.additional_config import SCHEDULER, WORKER_EXTENSION
from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV
from weaver.vllm_ext.plugin_pairs import plugin_weaving

pytest.importorskip("vllm")


@pytest.mark.parametrize(("block", "message"), [
    ({"role": "warm", "pair": "p"}, "use 'hot' or 'cold'"),
    ({"role": "hot", "pair": "p"}, "needs remote_kv_gib > 0"),
    ({"role": "hot", "pair": "p", "remote_kv_gib": 1, "offload_ratio": 2},
     "offload_ratio must be 'auto' or a number in"),
    ({"role": "cold", "pair": "p"}, "needs lend_kv_gib > 0"),
    ({"role": "cold", "pair": "p", "lend_kv_gib": 1, "remote_kv_gib": 1},
     r"unknown field\(s\) \['remote_kv_gib'\]"),
    ({"role": "hot", "pair": "a b", "remote_kv_gib": 1}, "weaving pair name 'a b'"),
])
def test_a_wrong_block_says_the_fix(block, message):
    with pytest.raises(ValueError, match=message):
        plugin_weaving({"weaver": block})


def test_other_engines_have_no_block():
    assert plugin_weaving({}) is None
    assert plugin_weaving({"weaver": {"hot": {"hot": "planned by weaver serve"}}}) is None
    cold = plugin_weaving({"weaver": {"role": "cold", "pair": ["p1", "p2"], "lend_kv_gib": 1}})
    assert cold.pairs == ("p1", "p2")


@pytest.fixture(autouse=True)
def _front_end_pid_restored(monkeypatch):
    """The config names its front end in the environment (for the engine it spawns); the
    test's process is not one, so the variable is put back after each test."""
    from weaver.vllm_ext.gateway_watch import GATEWAY_PID_ENV

    monkeypatch.setenv(GATEWAY_PID_ENV, "")


def engine_config(model_dir, block: dict, **engine_args):
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(model_dir), max_model_len=256, enforce_eager=True,
                      dtype="float32", additional_config={"weaver": block}, **engine_args)
    return args, args.create_engine_config()


def test_a_hot_block_sets_the_hooks_and_the_plan():
    from weaver.models.registry import prepare_model

    args, config = engine_config(prepare_model("tiny-llama-a"),
                                 {"role": "hot", "pair": "p1", "remote_kv_gib": 0.01},
                                 block_size=16)
    assert config.scheduler_config.scheduler_cls == SCHEDULER
    assert config.parallel_config.worker_extension_cls == WORKER_EXTENSION
    assert config.cache_config.enable_prefix_caching is False
    # The EngineCore this front end spawns watches it (weaver/vllm_ext/gateway_watch.py).
    assert os.environ[GATEWAY_PID_ENV] == str(os.getpid())
    (plan,) = config.additional_config["weaver"]["hot"]  # one plan: one cold engine
    # tiny-llama-a: 2 layers, 2 KV heads of 32; blocks of 16 tokens, fp32 K and V.
    block_bytes = 2 * 2 * 16 * 2 * 32 * 4
    assert plan["num_remote_blocks"] == int(0.01 * 2**30) // block_bytes
    # vLLM's served name is the model path; the cold side names the region later.
    assert (plan["cold"], plan["region_name"]) == ("p1", "")
    assert plan["hot"] == config.model_config.served_model_name
    assert plan["max_blocks_per_seq"] == 256 // 16


def test_a_cold_block_sets_only_the_worker_extension():
    from weaver.models.registry import prepare_model

    _, config = engine_config(prepare_model("tiny-llama-b"),
                              {"role": "cold", "pair": "p1", "lend_kv_gib": 0.1})
    assert config.parallel_config.worker_extension_cls == WORKER_EXTENSION
    assert "hot" not in config.additional_config["weaver"]
    assert "split" not in config.additional_config["weaver"]


def test_a_cold_block_with_a_split_gets_the_split_plan_its_layers_read():
    from weaver.models.registry import prepare_model
    from weaver.vllm_ext.additional_config import split_chunks_of

    block = {"role": "cold", "pair": "p1", "lend_kv_gib": 0.1, "split": {"lm_head": 4}}
    _, config = engine_config(prepare_model("tiny-llama-b"), block)
    assert split_chunks_of(config) == {"lm_head": 4}
    with pytest.raises(ValueError, match="unknown operator"):
        engine_config(prepare_model("tiny-llama-b"), {**block, "split": {"nope": 2}})


def test_a_block_and_a_foreign_scheduler_conflict():
    from weaver.models.registry import prepare_model

    with pytest.raises(ValueError, match="cannot be combined with Weaver's weaving block"):
        engine_config(prepare_model("tiny-llama-a"),
                      {"role": "hot", "pair": "p1", "remote_kv_gib": 0.01},
                      scheduler_cls="my.Scheduler")


def test_weavers_log_lines_reach_vllms_handlers_under_plain_vllm_serve():
    """The front end of `vllm serve` loads the plugin before vLLM configures its logging:
    Weaver's INFO lines must still come out, through vLLM's handler."""
    import subprocess
    import sys

    code = ("import logging, vllm.plugins as p; p.load_general_plugins()\n"
            "from vllm.logger import _configure_vllm_root_logger\n"
            "_configure_vllm_root_logger()\n"
            "logging.getLogger('weaver.x').info('weaving pair p1: connected')\n"
            "logging.getLogger('weaver.x').debug('not at INFO')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "INFO" in output and "weaving pair p1: connected" in output
    assert "not at INFO" not in output


def test_the_plugin_block_takes_the_deployment_files_defaults():
    """One default per policy field: a hot block that names none gets exactly what a
    deployment's weaving entry gets (weaver/config/deployment.py WeavingSpec)."""
    from weaver.config.deployment import WeavingSpec
    from weaver.vllm_ext.plugin_pairs import POLICY_FIELDS

    weaving = plugin_weaving({"weaver": {"role": "hot", "pair": "p", "remote_kv_gib": 1}})
    spec = WeavingSpec(hot="h", cold=["c"])
    assert dict(weaving.policy) == {name: getattr(spec, name) for name in POLICY_FIELDS}
    assert dict(weaving.policy)["offload_ratio"] == "auto"
