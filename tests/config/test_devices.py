"""A model's `device`: what its engine gets (weaver/config/devices.py) and what the
deployment validator refuses. No GPU is needed: the GPUs are given as an inventory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from weaver.config.deployment import load_deployment, parse_deployment
from weaver.config.devices import (
    VISIBLE_DEVICES_ENV,
    GiB,
    GpuInventory,
    check_devices,
    physical_gpu_ids,
    place_engines,
    weight_bytes,
)

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
H100 = 80 * GiB


def model(name: str, **extra) -> dict:
    return {"name": name, "model": "m", **extra}


def pair(hot_device: str, cold_device: str, **cold_extra) -> dict:
    return {"models": [model("h", role="hot", device=hot_device),
                       model("c", role="cold", device=cold_device, lend_kv_gib=1, **cold_extra)],
            "weaving": [{"hot": "h", "cold": ["c"]}]}


@pytest.fixture(autouse=True)
def _no_inherited_visible_devices(monkeypatch):
    monkeypatch.delenv(VISIBLE_DEVICES_ENV, raising=False)


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (pair("cpu", "cuda:0"), "a pair shares memory, so both run on cpu or both on cuda"),
        (pair("cuda:1", "cpu"), "'h' (cuda:1) -> 'c' (cpu)"),
        ({"models": [model("m", device="cuda:0", cpu_cores="0")]},
         "cpu_cores binds a cpu engine's threads; it is on cuda:0 (remove cpu_cores)"),
        ({"models": [model("m", gpu_memory_gib=4)]}, "gpu_memory_gib is for a cuda device"),
        (pair("cuda:0", "cuda:0", unified_kv=True), "unified KV pool runs on cpu engines only"),
    ],
)
def test_validator_refuses_what_cannot_work_and_says_the_fix(data, expected):
    with pytest.raises(ValueError) as info:
        parse_deployment(data)
    assert expected in str(info.value)


def test_each_engine_sees_its_own_gpu_first_and_a_hot_one_its_cold_models_gpus():
    deployment = parse_deployment(pair("cuda:1", "cuda:0"))
    placed = place_engines(deployment, {}, GpuInventory((H100, H100)))
    assert placed["h"].environment == {VISIBLE_DEVICES_ENV: "1,0"}
    assert placed["c"].environment == {VISIBLE_DEVICES_ENV: "0"}
    one_gpu = place_engines(parse_deployment(pair("cuda:0", "cuda:0")), {},
                            GpuInventory((H100,)))
    assert one_gpu["h"].environment == {VISIBLE_DEVICES_ENV: "0"}


def test_cuda_n_counts_the_gpus_this_process_sees():
    # Under CUDA_VISIBLE_DEVICES=2,3 (numbers or UUIDs), cuda:1 is the machine's GPU 3.
    assert physical_gpu_ids([1, 0], "2,3") == "3,2"
    assert physical_gpu_ids([0], "GPU-aa, GPU-bb") == "GPU-aa"
    with pytest.raises(ValueError, match="cuda:2 is not visible"):
        physical_gpu_ids([2], "2,3")


def test_cpu_engines_keep_their_core_binding_and_probe_no_gpu():
    deployment = parse_deployment({"models": [model("m", cpu_cores="1")]})
    placed = place_engines(deployment, {}, GpuInventory(()))
    assert placed["m"].environment == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert placed["m"].cli_args == ()


def test_a_budget_becomes_vllms_share_of_the_gpu_without_what_weaver_lends():
    data = pair("cuda:0", "cuda:0")
    data["models"][0].update(gpu_memory_gib=40, kv_cache_gib=20)
    data["models"][1].update(gpu_memory_gib=30, kv_cache_gib=8, lend_kv_gib=10)
    placed = place_engines(parse_deployment(data), {}, GpuInventory((H100,)))
    assert placed["h"].cli_args == ("--gpu-memory-utilization", "0.5")
    assert placed["c"].cli_args == ("--gpu-memory-utilization", "0.25")  # (30 - 10) / 80


def test_an_unstated_budget_is_weights_kv_lent_and_headroom(tmp_path):
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"\0" * (1 << 20))
    (model_dir / "config.json").write_text("{}")
    assert weight_bytes(model_dir) == 1 << 20
    data = {"models": [model("m", device="cuda:0", kv_cache_gib=6)]}
    placed = place_engines(parse_deployment(data), {"m": model_dir}, GpuInventory((16 * GiB,)))
    # (1 MiB + 6 GiB + 2 GiB headroom) / 16 GiB
    assert placed["m"].cli_args == ("--gpu-memory-utilization",
                                    str(round((8 + 1 / 1024) / 16, 4)))


def test_budgets_that_overflow_one_gpu_are_refused_with_the_fix():
    data = pair("cuda:0", "cuda:0")
    data["models"][0].update(gpu_memory_gib=50)
    data["models"][1].update(gpu_memory_gib=30)
    problems = check_devices(parse_deployment(data), GpuInventory((H100,)), {})
    assert problems == [
        "cuda:0 has 80.0 GiB; its engines' budgets (h 50.00 + c 30.00 GiB) and 2.0 GiB of "
        "CUDA contexts do not fit; lower gpu_memory_gib, kv_cache_gib or lend_kv_gib, or move "
        "a model to another GPU"]
    data["models"][1].update(device="cuda:1")
    assert check_devices(parse_deployment(data), GpuInventory((H100, H100)), {}) == []


def test_a_gpu_deployment_without_a_gpu_or_with_a_missing_one_is_refused():
    deployment = parse_deployment(pair("cuda:0", "cuda:1"))
    (problem,) = check_devices(deployment, GpuInventory(()), {})
    assert "this machine has no visible GPU" in problem and "set device: cpu" in problem
    (problem,) = check_devices(deployment, GpuInventory((H100,)), {})
    assert problem == ("model 'c': device cuda:1 does not exist here (visible GPUs: "
                       "cuda:0-cuda:0)")
    with pytest.raises(ValueError, match="devices cannot work here"):
        place_engines(deployment, {}, GpuInventory(()))


def test_a_stated_budget_must_hold_weights_kv_and_lent_memory():
    data = {"models": [model("m", device="cuda:0", kv_cache_gib=10, gpu_memory_gib=12)]}
    (problem,) = check_devices(parse_deployment(data), GpuInventory((H100,)), {"m": 4 * GiB})
    assert "gpu_memory_gib 12.0 is less than its weights + kv_cache_gib + lend_kv_gib " \
           "(14.00 GiB)" in problem


@pytest.mark.parametrize("name", ["gpu_two_gpus.yaml", "gpu_one_gpu.yaml"])
def test_gpu_examples_fit_an_80_gib_gpu_and_say_what_each_engine_gets(name, tmp_path, capsys):
    """The GPU examples of docs/gpus.md, through `weaver config --engines` with two 80 GiB GPUs and
    stand-in model directories (the config.json of the real models' shapes; weights not
    needed by the command)."""
    from weaver.cli.main import main

    shapes = {"llama3-8b": (32, 8, 4096), "llama2-7b": (32, 32, 4096)}
    data = yaml.safe_load((EXAMPLES / name).read_text())
    for spec in data["models"]:
        layers, kv_heads, hidden = shapes[spec["name"]]
        model_dir = tmp_path / spec["name"]
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps({
            "num_hidden_layers": layers, "num_attention_heads": 32,
            "num_key_value_heads": kv_heads, "hidden_size": hidden}))
        spec["model"] = str(model_dir)
    config = tmp_path / name
    config.write_text(yaml.safe_dump(data))
    assert load_deployment(EXAMPLES / name).weaving  # the shipped file itself validates

    assert main(["config", str(config), "--engines", "--gpus", "80,80"]) == 0
    out = capsys.readouterr().out
    hot, cold = (block for block in out.split("\n\n") if block.strip())
    two_gpus = name == "gpu_two_gpus.yaml"
    assert hot.splitlines()[1].startswith(
        f"{VISIBLE_DEVICES_ENV}={'0,1' if two_gpus else '0'} vllm serve ")
    assert cold.splitlines()[1].startswith(
        f"{VISIBLE_DEVICES_ENV}={'1' if two_gpus else '0'} vllm serve ")
    for block, utilization in zip((hot, cold), ("0.75", "0.375") if two_gpus else
                                  ("0.475", "0.3"), strict=True):
        assert f"--gpu-memory-utilization {utilization} " in block
        assert "--enforce-eager" in block
    assert "--block-size 16" in hot  # vLLM's CUDA default, and the remote pool's


def test_a_cuda_pair_plans_its_region_in_the_gpu_backends_kv_format(tmp_path):
    from weaver.weaving.plan import plan_pairs

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "hidden_size": 128}))
    for hot_device, kv_format, block_size in (("cuda:0", "token", 16), ("cpu", "pages", 128)):
        data = pair(hot_device, hot_device)
        (plan,) = plan_pairs(parse_deployment(data), {"h": model_dir, "c": model_dir}, "t")
        assert (plan.shape.kv_format, plan.shape.block_size) == (kv_format, block_size)
        assert plan.layout().kv_layer_shape[1:] == (2, block_size, 64)


def test_serve_refuses_a_gpu_deployment_here_before_starting_any_engine(tmp_path, monkeypatch):
    """This machine has no GPU: `weaver serve` says so and the fix, and starts nothing."""
    from weaver.cli.main import main
    from weaver.config import devices

    monkeypatch.setattr(devices, "probe_gpus", lambda: GpuInventory(()))
    model_dir = tmp_path / "m"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    data = pair("cuda:0", "cuda:0")
    for spec in data["models"]:
        spec["model"] = str(model_dir)
    config = tmp_path / "gpu.yaml"
    config.write_text(yaml.safe_dump(data))
    with pytest.raises(SystemExit) as info:
        main(["serve", str(config)])
    assert "this machine has no visible GPU" in str(info.value.code)
    assert "set device: cpu" in str(info.value.code)


def test_config_refuses_what_serve_would_refuse(tmp_path, capsys):
    """`weaver config FILE` runs the plans `weaver serve` makes before its engines start:
    a hot model over two cold ones, one of which keeps its KV in a unified pool, passes
    the schema but not the weaving plan."""
    from weaver.cli.main import main

    model_dir = tmp_path / "m"
    model_dir.mkdir()
    model_dir.joinpath("config.json").write_text(json.dumps({
        "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "hidden_size": 576}))
    small = {"model": str(model_dir), "max_model_len": 512, "block_size": 32}
    data = {"models": [{"name": "h", "role": "hot", **small},
                       {"name": "c1", "role": "cold", "lend_kv_gib": 0.05, **small},
                       {"name": "c2", "role": "cold", "lend_kv_gib": 0.05, "unified_kv": True,
                        **small}],
            "weaving": [{"hot": "h", "cold": ["c1", "c2"]}]}
    config = tmp_path / "two_colds.yaml"
    config.write_text(yaml.safe_dump(data))
    assert main(["config", str(config)]) == 1
    assert "weave into it alone" in capsys.readouterr().out
    data["weaving"] = [{"hot": "h", "cold": ["c1"]}]
    data["models"] = data["models"][:2]
    config.write_text(yaml.safe_dump(data))
    assert main(["config", str(config)]) == 0
    assert "not checked" not in capsys.readouterr().out
