"""Weaving end to end on real vLLM engines, through the OpenAI endpoint.

One server hosts eight engines: `ref` (SmolLM2, dedicated: weaving off), `hot` (the same
model weaving into `cold` with `offload_ratio: auto`: local first, and remote once its
local KV is full, while weaving pays: weaver/weaving/placement.py), `hot-all` (every
sequence remote, each on one of two colds, `cold` or `cold2`, whichever has more free lent
blocks), `cold` (a random-weight Llama of another shape: 3 layers, 6 q / 1 kv heads, head
64, against SmolLM2's 30 layers, 9 q / 3 kv heads; `hot` and `hot-all` share what it lends
in one loan pool the gateway hosts, quotas moved by ADBS: weaver/weaving/plan.py
plan_loan_pools), `cold2` (another shape again: 2 layers, 4 q / 2 kv heads, head 32; a
region of 45 blocks for `hot-all` alone, so that `hot-all`'s sequences still go to
`cold` once `hot` holds most of its loan), and `mux-a`, `mux-b`
(SmolLM2 twice, colocated in a spatial-temporal mux group, taking turns step by step:
weaver/mux/, their KV in one pool the gateway hosts, quotas moved by ADBS:
weaver/server/mux_pool.py). The SmolLM2 engines have the same capped local KV (16 usable
blocks of 32 tokens; `mux-b` brings 48 to the pool, so `mux-a` can borrow up to 32 more)
and a small prefill chunk (64 tokens), so long prompts span several chunks and the batch
is KV-bound. Tests run in file order; the last ones kill `cold` and stop the server.
Engine restarts are off here, so a killed cold engine stays down and its pairs stay
degraded; restarts and re-attachment are pinned in tests/server/test_serve_e2e.py.
"""

from __future__ import annotations

import concurrent.futures as cf
import signal
import time
from pathlib import Path

import openai
import psutil
import pytest
from weaving_client import (
    PoolWatcher,
    complete_all,
    make_prompts,
    metric,
    openai_client,
    pool_gauges,
)

from weaver.bench.server_process import weaver_server
from weaver.mux.table import table_path

pytestmark = pytest.mark.engine(seconds=540)

# 16 prompts (~2200 prompt tokens, 88 blocks with their answers): a dedicated engine's 16
# blocks hold 3-5 of them at once, the hot ones' 16 + 91 remote blocks all of them (peak
# running seen: ref 4, hot 11, mux-a 10). 32 prompts took the module 680 s alone, 16 418 s.
NUM_PROMPTS = 16
MUX_MODELS = ("mux-a", "mux-b")
LOCAL_BLOCKS = 17  # 16 usable: block 0 is vLLM's null block
SMOLLM2_ENGINE = """
    model: {smollm2}
    kv_cache_gib: 0.25
    max_model_len: 512
    block_size: 32
    num_gpu_blocks_override: {local_blocks}
    max_num_seqs: 48
    extra_engine_args: {{max_num_batched_tokens: 64}}"""

DEPLOYMENT = """
models:
  - name: ref
    role: dedicated{engine}
  - name: hot
    role: hot{engine}
  - name: hot-all
    role: hot{engine}
  - name: mux-a
    role: dedicated{engine}
  - name: mux-b
    role: dedicated{mux_b_engine}
  - name: cold
    model: {tiny}
    role: cold
    kv_cache_gib: 0.1
    max_model_len: 512
    lend_kv_gib: 0.125
  - name: cold2
    model: {tiny2}
    role: cold
    kv_cache_gib: 0.1
    max_model_len: 512
    lend_kv_gib: 0.0625
serving:
  restart: {{enabled: false}}
mux:
  - {{name: pair, models: [mux-a, mux-b], mode: spatial-temporal, rates: {{mux-a: 3, mux-b: 1}},
     unified_kv: true}}
weaving:
  - {{hot: hot, cold: [cold], offload_ratio: auto, hot_tpot_ms: 60000, timeout_s: 3.0}}
  - {{hot: hot-all, cold: [cold, cold2], offload_ratio: 1.0, timeout_s: 3.0}}
"""



@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2_dir):
    from weaver.models.registry import prepare_model

    tiny, tiny2 = prepare_model("tiny-llama-b"), prepare_model("tiny-llama-a")
    root = tmp_path_factory.mktemp("weaving")
    config = root / "deployment.yaml"
    engine = SMOLLM2_ENGINE.format(smollm2=smollm2_dir, local_blocks=LOCAL_BLOCKS)
    mux_b_engine = SMOLLM2_ENGINE.format(smollm2=smollm2_dir, local_blocks=3 * LOCAL_BLOCKS - 2)
    config.write_text(DEPLOYMENT.format(engine=engine, mux_b_engine=mux_b_engine, tiny=tiny,
                                        tiny2=tiny2))
    with weaver_server(config, root / "serve.log") as running:
        yield running


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)




@pytest.fixture(scope="module")
def reference(server, client) -> dict:
    prompts = make_prompts(NUM_PROMPTS)
    outputs = complete_all(client, "ref", prompts)
    # vLLM's own SchedulerStats, as the gateway exports them per model.
    peak = metric(server, 'weaver_peak_running{model="ref"}')
    return {"prompts": prompts, "outputs": outputs, "peak_running": peak}


def tasks_of(server, hot: str, cold: str) -> float:
    return metric(server, f'weaver_offload_tasks_total{{cold="{cold}",hot="{hot}"}}')


def test_all_remote_over_two_colds_is_token_exact(server, client, reference):
    # First of the module's weaving tests: `hot-all` starts from half of `cold`'s loan
    # pool (later tests move quota to `hot`), so its sequences go to both colds, each to
    # whichever can lend more blocks.
    outputs = complete_all(client, "hot-all", reference["prompts"])
    assert outputs == reference["outputs"]
    assert metric(server, 'weaver_offload_sequences_total{model="hot-all"}') >= NUM_PROMPTS
    assert tasks_of(server, "hot-all", "cold") > 0 and tasks_of(server, "hot-all", "cold2") > 0
    assert metric(server, 'weaver_offload_fallbacks_total{model="hot-all"}') == 0


def test_auto_is_token_exact_and_fills_the_remote_pool_when_kv_bound(
        server, client, reference):
    outputs = complete_all(client, "hot", reference["prompts"])
    peak = metric(server, 'weaver_peak_running{model="hot"}')
    assert outputs == reference["outputs"]
    # A loose TPOT target and an idle cold model: weaving paid all along, and says so.
    assert metric(server, 'weaver_weaving_active{cold="cold",hot="hot"}') == 1
    assert metric(server, 'weaver_weaving_step_asides_total{cold="cold",hot="hot"}') == 0
    pair = next(p for p in server.health().json()["weaving"] if p["hot"] == "hot")
    assert pair["offload_ratio"] == "auto" and pair["weaving_active"] is True
    assert metric(server, 'weaver_offload_sequences_total{model="hot"}') >= NUM_PROMPTS // 2
    assert metric(server, 'weaver_offload_tasks_total{cold="cold",hot="hot"}') > 0
    # The cold side's time on those tasks, whether at poll points or by its idle poller.
    assert metric(server, "weaver_offload_cold_busy_seconds_total") > 0
    # Capacity: same local KV, plus the lent blocks (acceptance: >= 1.8x).
    print(f"peak running: ref {reference['peak_running']}, hot {peak}")
    assert reference["peak_running"] > 0
    assert peak >= 1.8 * reference["peak_running"]


def test_the_busier_of_two_hots_gets_more_of_colds_loan(server, client, reference):
    """`hot` (16 requests, KV-bound: its remote blocks all on `cold`) and `hot-all` (2
    requests, each on whichever of `cold` and `cold2` can lend more) at once. They share
    `cold`'s 0.125 GiB (91 SmolLM2 blocks) in one loan pool, each starting from half of it;
    ADBS moves quota to the one short of blocks, so the busier one holds more than an
    equal, fixed region would give it. Both stay token-exact."""
    tasks_before = tasks_of(server, "hot", "cold")
    with PoolWatcher(server, ("hot", "hot-all")) as watcher, cf.ThreadPoolExecutor(2) as pool:
        busy = pool.submit(complete_all, client, "hot", reference["prompts"])
        light = pool.submit(complete_all, client, "hot-all", reference["prompts"][:2])
        assert busy.result(timeout=600) == reference["outputs"]
        assert light.result(timeout=600) == reference["outputs"][:2]
    _, _, size = pool_gauges(server)
    print(f"loan pool of {size:.0f} pages: peak pages {watcher.peak_pages}, "
          f"peak quota {watcher.peak_quota}")
    assert watcher.peak_pages["hot"] > size / 2 > watcher.peak_pages["hot-all"]
    assert watcher.peak_quota["hot"] > size / 2
    assert tasks_of(server, "hot", "cold") > tasks_before  # its decode attention ran there
    pair = next(p for p in server.health().json()["weaving"] if p["hot"] == "hot")
    assert pair["remote_kv_in"] == "loan pool"


def test_an_idle_colocated_model_lends_its_pool_quota(server, client, reference):
    # mux-b idles, so ADBS moves its unused quota (down to one 512-token sequence) to
    # mux-a, which then runs larger batches than its own 16 blocks allow (ref's). Quota
    # moves once a second while mux-a is short, so the first round mostly moves it (how
    # far it gets depends on timing) and the second runs on it: mux-a keeps the quota
    # while nobody else is short.
    for _ in range(2):
        assert complete_all(client, "mux-a", reference["prompts"]) == reference["outputs"]
    assert metric(server, 'weaver_mux_kv_quota_moved_pages_total{group="pair"}') > 0
    quota = metric(server, 'weaver_mux_kv_quota_pages{group="pair",model="mux-a"}')
    assert quota > metric(server, 'weaver_mux_kv_quota_pages{group="pair",model="mux-b"}')
    peak = metric(server, 'weaver_peak_running{model="mux-a"}')
    print(f"peak running: ref {reference['peak_running']}, mux-a {peak}")
    assert peak >= 1.5 * reference["peak_running"]


def test_colocated_models_take_turns_and_stay_token_exact(server, client, reference):
    prompts = reference["prompts"][:8]
    with cf.ThreadPoolExecutor(2) as pool:  # both models at once, so their steps interleave
        runs = [pool.submit(complete_all, client, model, prompts) for model in MUX_MODELS]
        outputs = [run.result(timeout=600) for run in runs]
    assert outputs == [reference["outputs"][:8]] * 2
    for model in MUX_MODELS:  # labels as the exposition sorts them
        for kind, least in (("prefill", 1), ("decode", 23)):
            series = f'weaver_mux_steps_total{{group="pair",kind="{kind}",model="{model}"}}'
            assert metric(server, series) >= least
        labels = f'{{group="pair",model="{model}"}}'
        assert metric(server, f"weaver_mux_turn_wait_seconds_total{labels}") > 0
        assert metric(server, f"weaver_mux_reclaimed_turns_total{labels}") == 0


def test_health_reports_weaving_pairs(server):
    pairs = {(p["hot"], p["cold"]): p for p in server.health().json()["weaving"]}
    assert pairs[("hot", "cold")]["status"] == "ok"
    assert pairs[("hot-all", "cold")]["offload_ratio"] == 1.0
    assert pairs[("hot-all", "cold2")]["status"] == "ok"  # one pair per cold


def test_killing_one_of_two_colds_mid_run_falls_back_its_sequences_only(
        server, client, reference):
    """`cold` SIGKILLed mid-run: the sequences whose KV it holds are attended on the hot
    side from their remote KV, new ones go to `cold2`, which keeps serving; nothing is
    lost. (`hot`'s pair with `cold` degrades too.)"""
    cold_pids = server.health().json()["models"]["cold"]["engine_pids"]
    on_cold = tasks_of(server, "hot-all", "cold")
    with cf.ThreadPoolExecutor(1) as pool:
        pending = pool.submit(complete_all, client, "hot-all", reference["prompts"])
        deadline = time.monotonic() + 120
        while tasks_of(server, "hot-all", "cold") < on_cold + 600:
            assert time.monotonic() < deadline and not pending.done()
            time.sleep(0.2)
        on_cold2_at_kill = tasks_of(server, "hot-all", "cold2")
        for pid in cold_pids:
            psutil.Process(pid).kill()
        outputs = pending.result(timeout=600)
    assert outputs == reference["outputs"]
    assert metric(server, 'weaver_offload_fallbacks_total{model="hot-all"}') > 0
    assert tasks_of(server, "hot-all", "cold2") > on_cold2_at_kill  # served after the kill
    pairs = {(p["hot"], p["cold"]): p for p in server.health().json()["weaving"]}
    assert pairs[("hot-all", "cold")]["status"] == "degraded"
    assert pairs[("hot-all", "cold2")]["status"] == "ok"


def test_no_shared_memory_left_after_sigterm(server):
    prefix = f"weaver{server.process.pid}-"
    assert server.stop(signal.SIGTERM) == 0
    leftovers = [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
    assert leftovers == []
    assert not table_path(f"weaver{server.process.pid}-pair").parent.exists()
