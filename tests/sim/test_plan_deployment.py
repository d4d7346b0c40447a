"""Plans become deployment files (`weaver plan --deployments`), and read back the same."""

from __future__ import annotations

import json

import pytest
import yaml

from weaver.cli.main import build_parser
from weaver.config.deployment import load_deployment, parse_deployment
from weaver.sim.config import SimConfig
from weaver.sim.deployment import sim_config_from_deployment
from weaver.sim.plan import GpuPlan, Plan, WeavePair
from weaver.sim.plan_deployment import deployment_from_plan
from weaver.workloads.types import TraceRequest

MODEL = "smollm2-135m-instruct"


@pytest.fixture
def cpu_config(cpu_profile):
    """Three models on two cores, as a cpu config names them (measured profile, blocks)."""
    profile = cpu_profile

    def make(**overrides) -> SimConfig:
        models = [{"name": n, "rate": r, "profile": str(profile), "num_blocks": b,
                   "block_size": 32, "serve": MODEL}
                  for n, r, b in (("chat", 2.0, 64), ("code", 0.5, 44), ("docs", 0.2, 44))]
        data = {"name": "three", "duration_s": 10.0, "cluster": {"device": "cpu",
                                                                  "num_gpus": 2},
                "workload": {"trace": "azure-conv", "length_scale": 0.1},
                "models": models, "slo": {"tpot_ms": 500}}
        data.update(overrides)
        return SimConfig.model_validate(data)

    return make


def test_shared_device_becomes_a_mux_group_and_reads_back_the_same(cpu_config, tmp_path):
    config = cpu_config()
    plan = Plan([GpuPlan(["chat"]), GpuPlan(["code", "docs"])])
    data = deployment_from_plan(config, plan)
    chat, code, docs = data["models"]
    assert (chat["role"], chat["cpu_cores"], chat["model"]) == ("dedicated", "0", MODEL)
    assert "cpu_cores" not in code  # the group binds its models
    assert data["mux"] == [{"name": "core1", "models": ["code", "docs"],
                            "mode": "spatial-temporal", "cpu_cores": "1",
                            "rates": {"code": 0.5, "docs": 0.2}}]
    deployment = parse_deployment(data)
    assert deployment.model("docs").cpu_cores == "1"
    # The simulator's copy of the written file is the plan it came from.
    profiles = {m.name: m.profile for m in config.models}
    back = sim_config_from_deployment(deployment, profiles,
                                      [TraceRequest(0.0, 10, 5, "chat", 0)])
    assert [m.num_blocks for m in back.models] == [64, 44, 44]
    assert [g.models for g in back.placement.gpus] == [["chat"], ["code", "docs"]]
    assert back.placement.gpus[1].mux.weights == {"code": 0.5, "docs": 0.2}


def test_weaving_pair_lends_the_planned_blocks(cpu_config):
    plan = Plan([GpuPlan(["chat"]), GpuPlan(["code"]), GpuPlan(["docs"])],
                [WeavePair(0, 1, 0.5, remote_blocks=32)])
    config = cpu_config(cluster={"device": "cpu", "num_gpus": 3})
    data = deployment_from_plan(config, plan)
    roles = {m["name"]: m["role"] for m in data["models"]}
    assert roles == {"chat": "hot", "code": "cold", "docs": "dedicated"}
    assert data["weaving"] == [{"hot": "chat", "cold": ["code"], "offload_ratio": 0.5}]
    deployment = parse_deployment(data)
    back = sim_config_from_deployment(deployment, {m.name: m.profile for m in config.models},
                                      [TraceRequest(0.0, 10, 5, "chat", 0)])
    assert back.placement.pairs[0].remote_blocks == 32
    # The planner's own pairs lend weaving.region_fraction (0.5) of the cold model's KV:
    # the file keeps the rest as the cold engine's, and lends the share apart.
    plan.pairs = [WeavePair(0, 1, 0.5)]
    data = deployment_from_plan(config, plan)
    cold = next(m for m in data["models"] if m["name"] == "code")
    assert cold["num_gpu_blocks_override"] == 22 + 1  # 44 blocks, half kept
    hot = next(m for m in data["models"] if m["name"] == "chat")
    assert hot["max_model_len"] == 22 * 32  # a whole sequence fits in what is lent
    back = sim_config_from_deployment(parse_deployment(data),
                                      {m.name: m.profile for m in config.models},
                                      [TraceRequest(0.0, 10, 5, "chat", 0)])
    assert back.placement.pairs[0].remote_blocks == 22  # same block bytes: half lent


def test_a_hot_model_over_two_colds_is_one_weaving_entry(cpu_config):
    """The planner's fan-in (one hot GPU, two pairs) is written as `weaving: [{hot, cold:
    [a, b]}]`, which the server and the simulator read back as the same two pairs."""
    plan = Plan([GpuPlan(["chat"]), GpuPlan(["code"]), GpuPlan(["docs"])],
                [WeavePair(0, 1, "auto", remote_blocks=32, hot_tpot_ms=425.0),
                 WeavePair(0, 2, "auto", remote_blocks=16, hot_tpot_ms=425.0)])
    config = cpu_config(cluster={"device": "cpu", "num_gpus": 3})
    data = deployment_from_plan(config, plan)
    assert data["weaving"] == [{"hot": "chat", "cold": ["code", "docs"],
                                "offload_ratio": "auto", "hot_tpot_ms": 425.0}]
    hot = next(m for m in data["models"] if m["name"] == "chat")
    assert hot["max_model_len"] == 16 * 32  # a whole sequence fits on either cold
    back = sim_config_from_deployment(parse_deployment(data),
                                      {m.name: m.profile for m in config.models},
                                      [TraceRequest(0.0, 10, 5, "chat", 0)])
    assert [(p.hot_gpu, p.cold_gpu, p.remote_blocks) for p in back.placement.pairs] == [
        (0, 1, 32), (0, 2, 16)]
    plan.pairs[1].offload_ratio = 0.5
    with pytest.raises(ValueError, match="one offload_ratio"):
        deployment_from_plan(config, plan)


def test_what_a_deployment_cannot_hold_is_refused(cpu_config):
    config = cpu_config()
    with pytest.raises(ValueError, match="one engine per model"):
        deployment_from_plan(config, Plan([GpuPlan(["chat", "code"]),
                                           GpuPlan(["chat", "docs"])]))
    with pytest.raises(ValueError, match="to itself"):
        deployment_from_plan(config, Plan([GpuPlan(["chat", "docs"]), GpuPlan(["code"])],
                                          [WeavePair(0, 1, 0.5, 32)]))
    unserved = cpu_config()
    unserved.models[0].serve = None
    with pytest.raises(ValueError, match="serve"):
        deployment_from_plan(unserved, Plan([GpuPlan(["chat", "code", "docs"])]))


def test_plan_command_writes_servable_files(cpu_config, tmp_path, capsys):
    config_path = tmp_path / "three.yaml"
    config_path.write_text(yaml.safe_dump(cpu_config().model_dump(exclude_none=True)))
    out = tmp_path / "deployments"
    args = build_parser().parse_args(["plan", str(config_path), "--out", str(tmp_path),
                                      "--no-plot", "--deployments", str(out)])
    assert args.handler(args) == 0
    printed = capsys.readouterr().out
    written = sorted(p.name for p in out.iterdir())
    assert written[:2] == ["dedicated.yaml", "muxserve.yaml"]
    for path in out.iterdir():
        deployment = load_deployment(path)  # what `weaver serve` loads
        assert {m.name for m in deployment.models} == {"chat", "code", "docs"}
        assert f"weaver serve {path}" in printed
    # Three models on two cores: the baseline and the plain plan share a core.
    assert load_deployment(out / "dedicated.yaml").mux[0].mode == "temporal"
    # The answer a user needs: does weaving pay, by how much, with which knobs.
    assert "weaving pays here" in printed or "weaving does not pay here" in printed
    assert "offload_ratio" in printed and "region_fraction" in printed
    (group,) = load_deployment(out / "muxserve.yaml").mux
    assert group.mode == "spatial-temporal" and len(group.models) == 2
    # The planner simulated that group as the file has it: each engine its own blocks.
    plan = json.loads((tmp_path / "three" / "plan.json").read_text())
    plain = [c for c in plan["candidates"] if c["policy"] == "muxserve"]
    assert all(g["mux"]["own_kv"] for c in plain for g in c["plan"]["gpus"] if g["mux"])


def test_plan_command_refuses_a_config_without_serve_before_planning(tmp_path, caplog):
    args = build_parser().parse_args(["plan", "tiny", "--out", str(tmp_path), "--no-plot",
                                      "--deployments", str(tmp_path / "d")])
    assert args.handler(args) == 2
    assert "have no `serve:`" in caplog.text
    assert not (tmp_path / "d").exists() and not (tmp_path / "tiny").exists()


def _entry(label: str, policy: str, goodput: float, ratios: tuple = (),
           cold_factor: float | None = None, tokens: float = 100.0) -> dict:
    pairs = [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": r} for r in ratios]
    return {"label": label, "policy": policy, "plan": {"gpus": [], "pairs": pairs},
            "summary": {"_all": {"goodput_rps": goodput, "output_tokens_per_s": tokens}},
            "cold_tpot_factors": {} if cold_factor is None else {"cold": cold_factor},
            "within_cold_budget": cold_factor is None or cold_factor <= 1.10}


@pytest.mark.parametrize(("woven", "expected"), [
    (6.0, "weaving pays here: goodput +50% over the best plain placement, +100% over "
          "dedicated, token throughput +0% (offload_ratio auto, region_fraction 0.5, split "
          "none, 1 pair(s)); serve woven"),
    (3.0, "weaving does not pay here: goodput -25% against the best plain placement "
          "(offload_ratio auto, region_fraction 0.5, split none, 1 pair(s); a woven one "
          "must gain over 1%); serve plain"),
    # Within simulation noise (the planner's own rule for choosing it): not a gain.
    (4.02, "weaving does not pay here: goodput +0% against the best plain placement "
           "(offload_ratio auto, region_fraction 0.5, split none, 1 pair(s); a woven one "
           "must gain over 1%); serve plain"),
])
def test_the_plan_says_whether_weaving_pays(woven, expected):
    from weaver.sim.config import WeavingSpec
    from weaver.sim.plan_deployment import weaving_answer

    result = {"candidates": [_entry("plain", "muxserve", 4.0),
                             _entry("woven", "weaver", woven, ("auto",))],
              "baseline": _entry("dedicated", "dedicated", 3.0)}
    assert weaving_answer(result, WeavingSpec()) == expected
    result["candidates"].pop()
    assert weaving_answer(result, WeavingSpec()).startswith("weaving: not planned")


def test_a_woven_placement_over_the_cold_budget_is_not_served():
    """Goodput alone would take the fixed ratio (6 req/s) whose cold TPOT rose 1.16x; the
    plan serves the one within the budget, and says so when none is."""
    from weaver.sim.config import WeavingSpec
    from weaver.sim.plan_deployment import best_woven, weaving_answer

    over = _entry("woven-fixed", "weaver", 6.0, (0.25,), cold_factor=1.16)
    within = _entry("woven-auto", "weaver", 5.0, ("auto",), cold_factor=1.05)
    result = {"candidates": [_entry("plain", "muxserve", 4.0), over, within],
              "baseline": _entry("dedicated", "dedicated", 3.0)}
    assert best_woven(result)["label"] == "woven-auto"
    assert weaving_answer(result, WeavingSpec()).endswith(
        "serve woven-auto; not served, over the cold TPOT budget (cold_tpot_budget): "
        "woven-fixed (goodput 6.00 req/s, cold 1.16x)")
    over["summary"]["_all"]["goodput_rps"] = 4.5  # one below the served: not named
    assert weaving_answer(result, WeavingSpec()).endswith("serve woven-auto")
    over["summary"]["_all"]["goodput_rps"] = 6.0
    result["candidates"].remove(within)
    assert best_woven(result) is None
    assert weaving_answer(result, WeavingSpec()) == (
        "weaving does not pay here: every woven placement raises a cold model's TPOT over "
        "its budget (cold_tpot_budget; woven-fixed: cold 1.16x); serve plain")
