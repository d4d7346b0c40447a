import pytest

from weaver.sim.cluster import Cluster
from weaver.sim.engine import Engine
from weaver.sim.instance import SimRequest
from weaver.sim.plan import Plan, default_plan
from weaver.sim.policies import POLICY_CLASSES, get_policy
from weaver.sim.runner import simulate
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
