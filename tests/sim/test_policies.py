from __future__ import annotations

import dataclasses

import pytest

from weaver.mux.turns import Kind
from weaver.sim.cluster import Cluster
from weaver.sim.config import SimConfig
from weaver.sim.engine import Engine
from weaver.sim.instance import SimRequest
from weaver.sim.perf_model import mg1_poll_wait
from weaver.sim.plan import Plan, default_plan
from weaver.sim.policies import POLICY_CLASSES, get_policy
from weaver.sim.runner import generate_requests, simulate
from weaver.workloads.types import TraceRequest


def one_request(model="a", input_tokens=100, output_tokens=5):
    return [TraceRequest(0.0, input_tokens, output_tokens, model, 0)]


def test_registry_has_one_policy_per_name():
    assert set(POLICY_CLASSES) == {"dedicated", "mux_temporal", "muxserve", "splitwise",
                                   "weaver"}
    with pytest.raises(ValueError, match="unknown policy"):
        get_policy("fastest")


@pytest.mark.parametrize("policy", sorted(POLICY_CLASSES))
def test_every_policy_serves_one_request_with_exact_ttft(make_config, policy, lin):
    cfg = make_config([("a", 1.0)], num_gpus=2,
                      placement={"gpus": [{"models": ["a"]}, {"models": ["a"]}]})
    result = simulate(cfg, policy=policy, requests=one_request())
    rec = result["requests"][0]
    assert rec["ttft_s"] == pytest.approx(lin.prefill_time(100))
    assert result["summary"]["a"]["num_completed"] == 1


def test_splitwise_adds_exactly_the_kv_transfer_time(make_config, lin):
    placement = {"gpus": [{"models": ["a"], "role": "prompt"},
                          {"models": ["a"], "role": "token"}]}
    cfg = make_config([("a", 1.0)], num_gpus=2, placement=placement)
    split = simulate(cfg, policy="splitwise", requests=one_request())["requests"][0]
    dedicated = simulate(cfg, policy="dedicated", requests=one_request())["requests"][0]
    transfer = 1e-3 + 100 * lin.SHAPE.kv_bytes_per_token / 1e9  # linear profile's link
    assert dedicated["e2e_s"] == pytest.approx(
        lin.prefill_time(100) + sum(lin.decode_time(1, 100 + i) for i in range(4)))
    assert split["ttft_s"] == pytest.approx(dedicated["ttft_s"])
    assert split["e2e_s"] == pytest.approx(dedicated["e2e_s"] + transfer)
    assert split["instance"] == "gpu1-token"


def test_join_shortest_queue_spreads_simultaneous_arrivals(make_config):
    cfg = make_config([("a", 1.0)], num_gpus=3,
                      placement={"gpus": [{"models": ["a"]}] * 3})
    engine = Engine()
    policy = get_policy("dedicated")(Cluster(cfg, engine), default_plan(cfg))
    reqs = [SimRequest(TraceRequest(0.0, 50, 10, "a", i)) for i in range(3)]
    for req in reqs:
        engine.push(policy.route(req, 0.0))
    assert sorted(r.instance for r in reqs) == ["gpu0", "gpu1", "gpu2"]
    # gpu1 now holds one more request: the next arrival goes to a shorter queue.
    policy.instances[1].submit(SimRequest(TraceRequest(0.0, 50, 10, "a", 9)), 0.0)
    late = SimRequest(TraceRequest(0.0, 50, 10, "a", 4))
    policy.route(late, 0.0)
    assert late.instance == "gpu0"


def test_dedicated_refuses_shared_gpus(make_config):
    cfg = make_config([("a", 1.0), ("b", 1.0)], num_gpus=1,
                      placement={"gpus": [{"models": ["a", "b"]}]})
    with pytest.raises(ValueError, match="one model per GPU"):
        simulate(cfg, policy="dedicated")


def test_mux_policies_share_one_gpu_and_serve_everyone(make_config):
    cfg = make_config([("a", 6.0), ("b", 0.5)], num_gpus=1,
                      placement={"gpus": [{"models": ["a", "b"]}]})
    for policy in ("mux_temporal", "muxserve"):
        summary = simulate(cfg, policy=policy)["summary"]
        assert summary["a"]["num_completed"] == summary["a"]["num_submitted"] > 0
        assert summary["b"]["num_completed"] == summary["b"]["num_submitted"] > 0


class _MuxRun:
    """The muxserve policy over `requests` on one GPU, run by hand so that a test can
    watch the instance after every event."""

    def __init__(self, cfg, requests) -> None:
        self.engine = Engine()
        self.cluster = Cluster(cfg, self.engine)
        policy = get_policy("muxserve")(self.cluster, default_plan(cfg))
        (self.instance,) = policy.instances
        self.requests = [SimRequest(r) for r in requests]
        for req in self.requests:
            self.engine.schedule(req.trace.arrival_s, "arrive",
                                 lambda t, req=req: policy.route(req, t))

    def run(self, on_event=None) -> _MuxRun:
        self.engine.run(on_event=on_event)
        return self


@pytest.mark.parametrize("mode", ["temporal", "spatial-temporal"])
def test_muxed_gpu_steps_follow_the_groups_turn_rule(make_config, mode):
    cfg = make_config([("a", 6.0), ("b", 3.0)], num_gpus=1,
                      placement={"gpus": [{"models": ["a", "b"], "mux": {"mode": mode}}]})
    run = _MuxRun(cfg, generate_requests(cfg))
    most = []

    def check(_event):
        kinds = [step.kind for step in run.instance.running.values()]
        most.append(len(kinds))
        if mode == "temporal":
            assert len(kinds) <= 1
        else:  # a prefill beside another model's decode, nothing else
            assert len(kinds) <= 2 and (len(kinds) < 2 or set(kinds) == set(Kind))

    run.run(check)
    assert len(run.cluster.finished) == len(run.requests) > 20
    assert (max(most) == 2) == (mode == "spatial-temporal")
    assert (run.instance.num_overlapped > 0) == (mode == "spatial-temporal")


@pytest.mark.parametrize(("mode", "speed"), [("temporal", 0.5), ("spatial-temporal", 0.5),
                                             ("spatial-temporal", 0.8)])
def test_an_overlapping_prefill_shares_the_device(make_config, lin, mode, speed):
    # a decodes for seconds; b's 1000-token prompt arrives meanwhile.
    cfg = make_config([("a", 1.0), ("b", 1.0)], num_gpus=1,
                      placement={"gpus": [{"models": ["a", "b"], "mux": {"mode": mode}}]},
                      muxserve={"overlap_speed": speed})
    requests = [TraceRequest(0.0, 10, 200, "a", 0), TraceRequest(0.05, 1000, 2, "b", 1)]
    a, b = _MuxRun(cfg, requests).run().requests
    ttft = b.first_token_s - 0.05
    if mode == "temporal":  # after a's step in flight, alone: prefill goes first
        assert lin.prefill_time(1000) < ttft <= lin.prefill_time(1000) + lin.decode_time(1, 211)
    else:  # at once, beside a's decodes for its whole length
        assert ttft == pytest.approx(lin.prefill_time(1000) / speed)
    assert a.finish_s is not None


def test_a_busy_neighbour_slows_a_step_by_the_contended_speed(make_config):
    def finish(speed, with_b):
        cfg = make_config([("a", 1.0), ("b", 1.0)], num_gpus=1,
                          placement={"gpus": [{"models": ["a", "b"]}]},
                          muxserve={"contended_speed": speed})
        requests = [TraceRequest(0.0, 10, 50, "a", 0)]
        requests += [TraceRequest(0.0, 10, 50, "b", 1)] if with_b else []
        return _MuxRun(cfg, requests).run().requests[0].finish_s

    assert finish(0.5, with_b=False) == pytest.approx(finish(1.0, with_b=False))  # alone
    # Every step of the two runs while the other model has work: all take twice as long.
    assert finish(0.5, with_b=True) == pytest.approx(2 * finish(1.0, with_b=True), rel=0.02)


def test_own_kv_keeps_each_models_blocks(make_config):
    for own_kv, quotas in ((True, [40, 200]), (False, None)):
        cfg = make_config([("a", 9.0), ("b", 1.0)], num_gpus=1, placement={
            "gpus": [{"models": ["a", "b"], "mux": {"own_kv": own_kv}}]})
        data = cfg.model_dump()
        for model, blocks in zip(data["models"], (40, 200), strict=True):
            model["num_blocks"] = blocks
        cfg = SimConfig.model_validate(data)
        run = _MuxRun(cfg, generate_requests(cfg)).run()
        got = [s.local.quota_blocks for s in run.instance.servers.values()]
        if quotas:  # the engines' own KV, whatever the load
            assert got == quotas
        else:  # ADBS re-balanced one pool of 240 blocks by demand
            assert got != [40, 200] and sum(got) <= 240


def test_muxserve_quotas_follow_the_rates(make_config):
    cfg = make_config([("a", 9.0), ("b", 1.0)], num_gpus=1,
                      placement={"gpus": [{"models": ["a", "b"]}]})
    policy = get_policy("muxserve")(Cluster(cfg, Engine()), default_plan(cfg))
    servers = policy.instances[0].servers
    assert servers["a"].local.quota_blocks > 5 * servers["b"].local.quota_blocks


def test_weaving_offloads_hot_sequences_and_slows_the_cold_model(make_config):
    placement = {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}],
                 "pairs": [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": 0.5}]}
    cfg = make_config([("hot", 20.0), ("cold", 2.0)], num_gpus=2, placement=placement)
    woven = simulate(cfg, policy="weaver")["summary"]
    dedicated = simulate(cfg, policy="dedicated")["summary"]
    assert woven["hot"]["num_remote"] > 0 and dedicated["hot"]["num_remote"] == 0
    assert woven["cold"]["num_remote"] == 0
    assert woven["cold"]["tpot_s"]["mean"] > dedicated["cold"]["tpot_s"]["mean"]


def test_a_run_reports_each_colds_lent_kv_and_the_most_it_held(make_config):
    """simulate's lent_kv: one pool per cold GPU the hot model weaves into, in plan order
    (the regime map reads whether the lent KV filled from it); none without weaving."""
    placement = {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}, {"models": ["cold2"]}],
                 "pairs": [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": 0.5},
                           {"hot_gpu": 0, "cold_gpu": 2, "offload_ratio": 0.5}]}
    cfg = make_config([("hot", 20.0), ("cold", 2.0), ("cold2", 2.0)], num_gpus=3,
                      placement=placement)
    pools = simulate(cfg, policy="weaver", keep_requests=False)["lent_kv"]["hot"]
    assert len(pools) == 2 and pools[0]["capacity_blocks"] == pools[1]["capacity_blocks"] > 0
    assert all(0 < pool["peak_blocks"] <= pool["capacity_blocks"] for pool in pools)
    assert "lent_kv" not in simulate(cfg, policy="dedicated", keep_requests=False)


def test_a_split_cold_model_is_polled_between_its_chunks(make_config):
    """weaving.split: the cold GPU's operators as a task sees them, cut into a
    deployment's chunks; each extra chunk lengthens the cold step."""
    placement = {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}],
                 "pairs": [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": 0.5}]}
    cfg = make_config([("hot", 20.0), ("cold", 2.0)], num_gpus=2, placement=placement)
    unsplit = get_policy("weaver")(Cluster(cfg, Engine()), default_plan(cfg)).instances[1]
    split_cfg = cfg.model_copy(update={"weaving": cfg.weaving.model_copy(
        update={"split": {"lm_head": 4}})})
    split = get_policy("weaver")(Cluster(split_cfg, Engine()), default_plan(cfg)).instances[1]
    assert unsplit.operator_fractions is None and split.split_chunks == {"lm_head": 4}
    assert len(split.operator_fractions) == len(split.poll_context().operator_fractions)
    assert split.poll_overhead_s == pytest.approx(unsplit.poll_overhead_s + 3 * 4e-6)
    with pytest.raises(ValueError, match="lm_head"):
        SimConfig.model_validate({**cfg.model_dump(), "weaving": {"split": {"nope": 2}}})


def test_a_host_launched_task_waits_behind_the_whole_cold_step(make_config):
    """weaving.control cpu, the paper's ablation baseline: a task queued behind the cold
    step's pre-submitted kernels waits out half a step on average, not half an operator,
    and no poll kernel costs the cold step anything."""
    placement = {"gpus": [{"models": ["hot"]}, {"models": ["cold"]}],
                 "pairs": [{"hot_gpu": 0, "cold_gpu": 1, "offload_ratio": 0.5}]}
    cfg = make_config([("hot", 20.0), ("cold", 2.0)], num_gpus=2, placement=placement)
    gpu = get_policy("weaver")(Cluster(cfg, Engine()), default_plan(cfg)).instances[1]
    cpu_cfg = cfg.model_copy(update={"weaving": cfg.weaving.model_copy(
        update={"control": "cpu"})})
    cpu = get_policy("weaver")(Cluster(cpu_cfg, Engine()), default_plan(cfg)).instances[1]
    gpu_ctx, cpu_ctx = gpu.poll_context(), cpu.poll_context()
    busy = dataclasses.replace(cpu_ctx, busy_fraction=1.0)
    assert mg1_poll_wait(busy) == pytest.approx(busy.step_s / 2)
    assert mg1_poll_wait(busy) > 10 * mg1_poll_wait(dataclasses.replace(gpu_ctx,
                                                                        busy_fraction=1.0))
    assert cpu.poll_overhead_s == 0 < gpu.poll_overhead_s
    with pytest.raises(ValueError, match="split needs control: gpu"):
        SimConfig.model_validate({**cfg.model_dump(),
                                  "weaving": {"control": "cpu", "split": "plan"}})


def test_same_seed_same_results_other_seed_other_results(make_config):
    cfg = make_config([("a", 5.0), ("b", 1.0)], num_gpus=2)
    first = simulate(cfg, policy="weaver")
    again = simulate(cfg, policy="weaver")
    assert first["requests"] == again["requests"]
    other = simulate(cfg.model_copy(update={"seed": 7}), policy="weaver")
    assert other["requests"] != first["requests"]


def test_default_plan_gives_popular_models_the_extra_gpus(make_config):
    cfg = make_config([("rare", 1.0), ("popular", 9.0)], num_gpus=3)
    plan = default_plan(cfg)
    assert [g.models for g in plan.gpus] == [["popular"], ["rare"], ["popular"]]
    assert [(p.hot_gpu, p.cold_gpu) for p in plan.pairs] == [(0, 1)]
    assert Plan.from_dict(plan.to_dict()) == plan


def test_requests_for_unknown_models_are_refused(make_config):
    cfg = make_config([("a", 1.0)], num_gpus=1)
    with pytest.raises(ValueError, match="lacks"):
        simulate(cfg, requests=one_request(model="zzz"))


def test_a_tensor_parallel_muxserve_mesh_pays_its_all_reduces():
    """Two Llama-3-8B models on a 2-GPU mesh (MuxServe, tp: 2) against one GPU each
    (dedicated), both saturated: the mesh serves fewer tokens, and the gap is the modelled
    all-reduce cost (with free all-reduces it nearly closes)."""
    def tokens_per_s(policy: str, latency_us: float) -> float:
        gpus = ([{"models": ["a", "b"], "tp": 2}] if policy == "muxserve"
                else [{"models": ["a"]}, {"models": ["b"]}])
        cfg = SimConfig.model_validate({
            "name": "tp", "duration_s": 20.0, "drain_s": 0.0,
            "cluster": {"device": "A100-80GB", "num_gpus": 2},
            "workload": {"trace": "azure-conv", "length_scale": 0.25},
            "server": {"allreduce_latency_us": latency_us},
            "models": [{"name": n, "rate": 40.0, "shape": "llama-3-8b"} for n in "ab"],
            "placement": {"gpus": gpus}})
        summary = simulate(cfg, policy=policy, keep_requests=False)["summary"]
        return sum(summary[m]["output_tokens_per_s"] for m in "ab")

    dedicated = tokens_per_s("dedicated", 20.0)
    assert tokens_per_s("muxserve", 20.0) < 0.85 * dedicated
    assert tokens_per_s("muxserve", 0.0) > 0.9 * dedicated
    with pytest.raises(ValueError, match="uses 3 GPUs"):
        SimConfig.model_validate({
            "name": "x", "cluster": {"device": "A100-80GB", "num_gpus": 2},
            "models": [{"name": n, "rate": 1.0, "shape": "llama-3-8b"} for n in "ab"],
            "placement": {"gpus": [{"models": ["a"], "tp": 2}, {"models": ["b"]}]}})
