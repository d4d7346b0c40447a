import pytest

from weaver.sim.adaptive_feed import ColdLoad
from weaver.sim.engine import Engine
from weaver.sim.instance import (
    BlockPool,
    Instance,
    ModelServer,
    RemotePool,
    SeqSet,
    ServerConfig,
    SimRequest,
)
from weaver.sim.perf_model import LinkModel, OffloadCostModel, PerfModel
from weaver.weaving.placement_feed import PAIR_LOAD_INTERVAL_S
from weaver.workloads.types import TraceRequest

BLOCK = 16  # conftest.Linear.BLOCK


def make_server(lin, num_blocks: int, name: str = "m", max_num_seqs: int = 256):
    perf = PerfModel(lin.profile())
    cfg = ServerConfig(block_size=BLOCK, max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    server = ModelServer(name, perf, BlockPool(num_blocks * lin.BLOCK_BYTES), cfg)
    finished = []
    server.on_finished = finished.append
    return server, finished


def submit(engine, instance, requests):
    for req in requests:
        engine.schedule(req.trace.arrival_s, "arrival",
                        lambda t, req=req: instance.submit(req, t))


def request(input_tokens, output_tokens, arrival=0.0, model="m", rid=0):
    return SimRequest(TraceRequest(arrival, input_tokens, output_tokens, model, rid))


def test_one_request_has_exact_ttft_and_e2e(lin):
    engine = Engine()
    server, finished = make_server(lin, 1000)
    inst = Instance(engine, "gpu0", [server])
    req = request(100, 5)
    submit(engine, inst, [req])
    engine.run()
    assert finished == [req]
    assert req.first_token_s == pytest.approx(lin.prefill_time(100))
    expected_e2e = lin.prefill_time(100) + sum(lin.decode_time(1, 100 + i) for i in range(4))
    assert req.finish_s == pytest.approx(expected_e2e)
    assert server.local.num_blocks == 0 and server.local.pool.used_bytes == 0


def test_full_kv_makes_the_second_request_queue(lin):
    engine = Engine()
    server, finished = make_server(lin, 3)  # one request of 32 + 8 tokens needs all 3 blocks
    inst = Instance(engine, "gpu0", [server])
    first, second = request(32, 8, rid=0), request(32, 8, rid=1)
    submit(engine, inst, [first, second])
    engine.run()
    assert finished == [first, second]
    assert first.finish_s == pytest.approx(
        lin.prefill_time(32) + sum(lin.decode_time(1, 32 + i) for i in range(7)))
    assert second.first_token_s == pytest.approx(first.finish_s + lin.prefill_time(32))
    assert second.num_preemptions == 0


def test_growth_beyond_capacity_preempts_the_newest_and_recomputes(lin):
    engine = Engine()
    server, finished = make_server(lin, 4)
    inst = Instance(engine, "gpu0", [server])
    old, new = request(16, 40, 0.0, rid=0), request(16, 40, 0.001, rid=1)
    submit(engine, inst, [old, new])
    pool = server.local.pool
    engine.run(on_event=lambda ev: _check_pool(pool))
    assert set(finished) == {old, new}
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    assert new.first_token_s < old.finish_s < new.finish_s
    assert pool.used_bytes == 0


def _check_pool(pool):
    assert pool.used_bytes <= pool.capacity_bytes


def test_request_that_can_never_fit_is_rejected(lin):
    engine = Engine()
    server, finished = make_server(lin, 2)
    inst = Instance(engine, "gpu0", [server])
    req = request(100, 10)
    submit(engine, inst, [req])
    engine.run()
    assert finished == [req] and req.is_rejected and req.finish_s is None


def remote_pool(lin, hot, cold_inst, num_blocks: int) -> RemotePool:
    """`num_blocks` of the hot model lent on the cold instance's device."""
    return RemotePool(SeqSet(BlockPool(num_blocks * lin.BLOCK_BYTES), BLOCK, lin.BLOCK_BYTES),
                      cold_inst, OffloadCostModel(hot.perf, hot.perf, LinkModel(1e9, 1e-5)))


def _max_running(lin, weave: bool):
    engine = Engine()
    hot, finished = make_server(lin, 8, "hot")  # room for two requests of 40 + 20 tokens
    cold, _ = make_server(lin, 100, "cold")
    hot_inst = Instance(engine, "gpu0", [hot])
    cold_inst = Instance(engine, "gpu1", [cold])
    if weave:
        hot.remotes = [remote_pool(lin, hot, cold_inst, 8)]
        hot.offload_ratio = 0.5
    reqs = [request(40, 20, 0.0, "hot", i) for i in range(4)]
    submit(engine, hot_inst, reqs)
    peak = [0]
    engine.run(on_event=lambda ev: peak.__setitem__(0, max(peak[0], hot.num_running)))
    assert len(finished) == 4 and not any(r.num_preemptions for r in reqs)
    return peak[0], reqs, cold_inst


def test_weaving_raises_hot_batch_capacity(lin):
    alone, reqs, _ = _max_running(lin, weave=False)
    woven, woven_reqs, cold_inst = _max_running(lin, weave=True)
    assert alone == 2
    assert woven == 4
    assert sum(r.is_remote for r in woven_reqs) == 2
    assert not any(r.is_remote for r in reqs)
    # The cold device was told how much of its time the remote attention takes.
    assert set(cold_inst.external_loads) == {"gpu0/hot"}


def test_seq_set_block_accounting_matches_ceil(lin):
    pool = BlockPool(1000 * lin.BLOCK_BYTES)
    seqs = SeqSet(pool, BLOCK, lin.BLOCK_BYTES)
    joined = []
    step = 0
    for ctx in (1, 15, 16, 17, 40, 31):  # sequences join between decode steps
        req = request(ctx, 100)
        seqs.add(req, ctx, step, 0)
        joined.append(req)
        for _ in range(7):
            seqs.grow(step)
            seqs.advance()
            step += 1
            want = sum(-(-seqs.context_of(r, step) // BLOCK) for r in joined)
            assert seqs.num_blocks == want
            assert seqs.num_context_tokens == sum(seqs.context_of(r, step) for r in joined)
    seqs.remove(joined[2], step)
    assert seqs.num_blocks == sum(-(-seqs.context_of(r, step) // BLOCK) for r in joined
                                  if r is not joined[2])


def _woven_four_requests(lin, offload_ratio, offload_policy, placement=None):
    """A hot server with room for two requests of 40 + 20 tokens and 8 lent blocks, given
    four at once; returns them, with the hot server, once all finished."""
    engine = Engine()
    hot, finished = make_server(lin, 8, "hot")
    cold, _ = make_server(lin, 100, "cold")
    hot_inst, cold_inst = Instance(engine, "gpu0", [hot]), Instance(engine, "gpu1", [cold])
    hot.remotes = [remote_pool(lin, hot, cold_inst, 8)]
    hot.offload_ratio, hot.offload_policy = offload_ratio, offload_policy
    hot.placement = placement
    reqs = [request(40, 20, 0.0, "hot", i) for i in range(4)]
    submit(engine, hot_inst, reqs)
    engine.run()
    assert len(finished) == 4
    return reqs, hot


def test_overflow_offload_goes_remote_only_when_local_is_full(lin):
    reqs, _ = _woven_four_requests(lin, 1.0, "overflow")
    assert [r.is_remote for r in reqs] == [False, False, True, True]


def test_auto_placement_is_the_engines_own_local_first_and_feeds_on_the_steps(lin):
    """offload_ratio auto in the simulator: the hot scheduler's AdaptivePlacement, local
    first and remote once local is full, fed each simulated step."""
    from weaver.weaving.placement import AdaptivePlacement

    placement = AdaptivePlacement()
    decided_at = []
    update = placement.update
    placement.update = lambda now: decided_at.append(now) or update(now)
    reqs, hot = _woven_four_requests(lin, "auto", "ratio", placement)
    assert [r.is_remote for r in reqs] == [False, False, True, True]
    report = hot.placement.report()
    assert report["hot_woven_step_s"] is not None and report["weaving_active"]
    # The cold device's TPOT factor is fed too: its own model runs nothing, so 1.0.
    assert report["cold_inflation"] == 1.0
    # It decides as the engine's scheduler does: every PAIR_LOAD_INTERVAL_S, not each step.
    gaps = [b - a for a, b in zip(decided_at, decided_at[1:], strict=False)]
    assert decided_at and all(gap >= PAIR_LOAD_INTERVAL_S for gap in gaps)
    assert len(decided_at) < hot.num_steps
    # Each finished sequence's TPOT, rebuilt from the steps it saw, is the one measured.
    assert sorted(placement.tail.tpots_s) == pytest.approx(sorted(
        (r.finish_s - r.first_token_s) / (r.num_output - 1) for r in reqs))


def test_the_cold_tpot_factor_auto_reads_is_the_cold_sides_over_its_window():
    """As the cold worker measures it (weaver/weaving/cold_load.py): its steps with the
    offloaded tasks over its steps alone, over the last WINDOW_S; not the last hot step's
    share, which swung with each step's make-up."""
    load = ColdLoad()
    assert load.factor(0.0) == 1.0
    for _ in range(50):  # 2.2 s of steps 10 % longer for the tasks
        load.record(0.044, 0.004)
    assert load.factor(4.0) == pytest.approx(1.10)
    for _ in range(50):  # then 2 s unslowed: the window holds both
        load.record(0.040, 0.0)
    assert load.factor(8.0) == pytest.approx(4.2 / 4.0)
    assert load.factor(12.0) == pytest.approx(1.0)  # the slowed steps left the window


def _first_and_late(lin, scheduling):
    """A 100-token prompt decoding 20 tokens, and a 1500-token prompt arriving 0.1 s in,
    run to the end; the steps planned, in order."""
    engine = Engine()
    server, finished = make_server(lin, 1000)
    server.cfg.scheduling = scheduling
    inst = Instance(engine, "gpu0", [server])
    first, late = request(100, 20, 0.0, rid=0), request(1500, 2, 0.1, rid=1)
    submit(engine, inst, [first, late])
    plans = []
    plan_step = server.plan_step
    server.plan_step = lambda: plans.append(plan_step()) or plans[-1]
    engine.run()
    assert sorted(r.trace.request_id for r in finished) == [0, 1]
    return first, late, plans


@pytest.mark.parametrize("scheduling", ["chunked", "prefill_first"])
def test_prefill_first_stalls_decodes_for_whole_prompts(lin, scheduling):
    """vLLM 0.6's prefill-first steps (the Weaver paper's engine) against v1's chunked
    ones: a prompt arriving mid-decode gets a step of its own."""
    _, late, plans = _first_and_late(lin, scheduling)
    with_late = [p for p in plans if any(e.req is late for e, _ in p.chunks)]
    if scheduling == "prefill_first":
        assert [p.num_decode for p in with_late] == [0]  # one whole-prompt step, no decode
        assert [n for p in with_late for _, n in p.chunks] == [1500]
    else:  # the prompt rides along the decodes, in one chunk of the budget less them
        assert all(p.num_decode == 1 for p in with_late)


def test_prefill_first_trades_the_running_tpot_for_the_new_ttft(lin):
    """So the new prompt's first token comes sooner and the running sequence ends later."""
    runs = {scheduling: _first_and_late(lin, scheduling)[:2]
            for scheduling in ("chunked", "prefill_first")}
    (chunked_first, chunked_late), (first, late) = runs["chunked"], runs["prefill_first"]
    assert late.first_token_s < chunked_late.first_token_s
    assert first.finish_s > chunked_first.finish_s


def test_a_hot_model_over_two_colds_fills_both_and_each_cold_is_told_its_load(lin):
    engine = Engine()
    hot, finished = make_server(lin, 8, "hot")  # room for two requests of 40 + 20 tokens
    hot_inst = Instance(engine, "gpu0", [hot])
    colds = [Instance(engine, f"gpu{i}", [make_server(lin, 100, f"cold{i}")[0]])
             for i in (1, 2)]
    hot.remotes = [remote_pool(lin, hot, colds[0], 4), remote_pool(lin, hot, colds[1], 8)]
    hot.offload_ratio, hot.offload_policy = 1.0, "overflow"
    reqs = [request(40, 20, 0.0, "hot", i) for i in range(5)]
    submit(engine, hot_inst, reqs)
    peak = [0]
    engine.run(on_event=lambda ev: peak.__setitem__(0, max(peak[0], hot.num_running)))
    assert len(finished) == 5 and not any(r.num_preemptions for r in reqs)
    assert peak[0] == 5  # 2 local, 2 on the 8-block cold, 1 on the 4-block one
    assert sum(r.is_remote for r in reqs) == 3
    # Each pool's most blocks at once: both colds' lent KV filled.
    assert [r.seqs.num_peak_blocks for r in hot.remotes] == [4, 8]
    for cold in colds:
        assert set(cold.external_loads) == {"gpu0/hot"}
