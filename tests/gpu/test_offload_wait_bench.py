"""The parts of benchmarks/offload_wait.py that need no GPU: the exit without CUDA, the
summary and acceptance arithmetic, the plot drawn from saved JSON, the GEMM and attention
splits, the poll-point count, and the split profile and plan built from measured times."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "offload_wait.py"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


@pytest.fixture(scope="module")
def bench():
    return _load("offload_wait_bench")


def _entry(busy_p99: float, idle_p99: float, quiet_ms: float, busy_ms: float) -> dict:
    return {
        "busy_wait_us": {"n": 10, "p50": busy_p99 / 2, "p99": busy_p99},
        "idle_wait_us": {"n": 10, "p50": idle_p99 / 2, "p99": idle_p99},
        "no_traffic_step_ms": [quiet_ms] * 5,
        "busy_step_ms": [busy_ms] * 5,
        "num_failed": {"busy": 0, "idle": 1},
    }


def test_exits_with_code_2_and_a_reason_without_cuda(bench, capsys) -> None:
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert bench.main(["--quick"]) == 2
    assert "cannot run: no CUDA device" in capsys.readouterr().err


def test_bad_arguments_are_refused(bench) -> None:
    with pytest.raises(SystemExit):
        bench.parse_args(["--split-chunks", "1"])


def test_quick_mode_caps_the_work(bench) -> None:
    quick = bench.run_config(bench.parse_args(["--quick"]))
    full = bench.run_config(bench.parse_args([]))
    assert (
        quick.tasks_busy < full.tasks_busy
        and quick.num_no_traffic_steps < full.num_no_traffic_steps
    )


def test_summary_acceptance_and_plot_from_saved_json(bench, tmp_path: Path, capsys) -> None:
    results = {
        "a_cpu_launched": _entry(500.0, 40.0, 10.0, 10.8),
        "b_poll_kernel": _entry(40.0, 12.0, 10.1, 10.3),
        "c_poll_split": _entry(20.0, 12.0, 10.3, 10.4),
        "d_spin_kernel": _entry(30.0, 8.0, 10.5, 10.6),
    }
    report = bench.summarize(results, [10.0] * 7)
    acceptance = report["acceptance"]
    assert acceptance["busy_p99_a_over_b"]["value"] == pytest.approx(12.5)
    assert acceptance["busy_p99_a_over_b"]["passed"]
    assert acceptance["idle_round_trip_p99_us_b"]["passed"]
    assert acceptance["no_traffic_poll_overhead_b"]["value"] == pytest.approx(0.01)
    assert results["d_spin_kernel"]["busy_step_overhead"] == pytest.approx(0.06)
    report.update(gpu="Test GPU", command="python offload_wait.py --quick", receivers=results)
    path = tmp_path / "offload_wait-test.json"
    path.write_text(json.dumps(report))
    assert bench.main(["--plot-only", str(path)]) == 0
    assert path.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"
    bench.print_table(json.loads(path.read_text()))
    table = capsys.readouterr().out
    assert "a: CPU-launched" in table and "FAIL" not in table


def test_failed_acceptance_is_reported(bench) -> None:
    results = {
        "a_cpu_launched": _entry(100.0, 40.0, 10.0, 10.0),
        "b_poll_kernel": _entry(40.0, 30.0, 10.5, 10.5),
        "c_poll_split": _entry(20.0, 12.0, 10.0, 10.0),
        "d_spin_kernel": _entry(30.0, 8.0, 10.0, 10.0),
    }
    report = bench.summarize(results, [10.0])
    assert not any(check["passed"] for check in report["acceptance"].values())
    assert report["verdict"].startswith("FAIL: busy_p99_a_over_b")
    assert next(iter(report)) == "verdict"  # the saved JSON opens with it


def test_percentiles_ignore_missing_stamps(bench) -> None:
    stats = bench.percentiles_us([0, 1000, 2000, 3000, -5])
    assert stats["n"] == 3 and stats["p50"] == pytest.approx(2.0)
    assert bench.percentiles_us([0]) == {"n": 0}


def test_split_linear_equals_the_whole_product(bench) -> None:
    model = object.__new__(bench.ColdModel)
    x, w = torch.randn(5, 16), torch.randn(16, 70)
    whole = model._linear(x, w, lambda: None, 1)
    # 10 columns in 6 chunks: torch.chunk would make 5; every chunk must get its poll
    for width, num_chunks in ((70, 3), (10, 6)):
        polls: list[int] = []
        split = model._linear(x, w[:, :width], lambda polls=polls: polls.append(1), num_chunks)
        assert torch.allclose(split, whole[:, :width], atol=1e-5)
        assert len(polls) == num_chunks


def test_chunk_bounds_cut_like_the_planner(bench) -> None:
    assert bench.chunk_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]  # larger chunks first
    assert bench.chunk_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for size, num_chunks in ((3, 4), (3, 0)):
        with pytest.raises(ValueError, match="cannot cut"):
            bench.chunk_bounds(size, num_chunks)


def _fake_attention(library, q, kv_pool, seq_lens, block_table, scale, *, out):
    """A row-wise stand-in for the CUDA kernel: each output row depends on its own
    sequence's inputs only, as the real kernel's does."""
    out.copy_(q * seq_lens.view(-1, 1, 1) + block_table[:, :1].view(-1, 1, 1) + scale)


_TINY = dict(num_layers=2, hidden=8, intermediate=12, num_q_heads=2, num_kv_heads=1,
             head_size=4, vocab=10)  # fmt: skip


def _tiny_model(bench, batch: int = 3):
    """A ColdModel on CPU tensors with a row-wise fake attention kernel."""
    shape = bench.ColdShape(**_TINY)
    model = object.__new__(bench.ColdModel)
    model.shape = shape
    model._kernels = type("K", (), {"paged_decode_attention": staticmethod(_fake_attention)})
    model._library = None
    model.w_qkv = torch.randn(8, (2 + 2) * 4)
    model.w_o, model.w_gate_up = torch.randn(8, 8), torch.randn(8, 24)
    model.w_down, model.lm_head = torch.randn(12, 8), torch.randn(8, 10)
    model.kv_pool = None
    model.seq_lens = torch.arange(1, batch + 1, dtype=torch.int32)
    model.block_table = torch.arange(batch * 2, dtype=torch.int32).view(batch, 2)
    model.x0, model.attn_out = torch.randn(batch, 8), torch.zeros(batch, 2, 4)
    model.logits = torch.empty(batch, 10)
    return model


def test_attention_groups_write_the_rows_of_the_whole_batch(bench) -> None:
    model = _tiny_model(bench, batch=5)
    q = torch.randn(5, 2, 4)
    model._attention(q, lambda: None, 1)
    whole = model.attn_out.clone()
    model.attn_out.zero_()
    polls: list[int] = []
    model._attention(q, lambda: polls.append(1), 3)
    assert torch.equal(model.attn_out, whole) and len(polls) == 3


_MIXED = {"qkv": 2, "attn": 3, "o": 2, "gate_up": 4, "down": 2, "lm_head": 5}


@pytest.mark.parametrize("chunks", [{}, {"gate_up": 3, "down": 3, "lm_head": 3}, _MIXED])
def test_poll_points_follow_the_step(bench, chunks) -> None:
    """num_poll_points (in the JSON) and poll_point_names (how the profiling phase names
    its timestamps) match the polls step() really makes, operator by operator."""
    model = _tiny_model(bench)
    seen: list[str] = []
    names = {id(model.w_qkv): "qkv", id(model.w_o): "o", id(model.w_gate_up): "gate_up",
             id(model.w_down): "down", id(model.lm_head): "lm_head"}  # fmt: skip
    linear, attention = model._linear, model._attention

    def logged_linear(x, w, poll, num_chunks):
        return linear(x, w, lambda: (seen.append(names[id(w)]), poll()), num_chunks)

    def logged_attention(q, poll, num_groups):
        attention(q, lambda: (seen.append("attn"), poll()), num_groups)

    model._linear, model._attention = logged_linear, logged_attention
    polls: list[int] = []
    model.step(lambda: polls.append(1), chunks)
    assert seen == model.poll_point_names(chunks)
    assert len(polls) == len(seen) == model.num_poll_points(chunks)


@pytest.fixture
def fake_cuda_clock(monkeypatch) -> list[float]:
    """torch.cuda.Event replaced by one that reads a clock (ms) the test advances."""
    clock = [0.0]

    class FakeEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = math.nan

        def record(self) -> None:
            self.at = clock[0]

        def synchronize(self) -> None:
            pass

        def elapsed_time(self, end: FakeEvent) -> float:
            return end.at - self.at

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    return clock


_COST_MS = {"qkv": 1.0, "attn": 2.0, "o": 3.0, "gate_up": 4.0, "down": 5.0, "lm_head": 6.0}


def _costly_model(bench, clock: list[float]):
    """The tiny model, each operator advancing the fake clock by its _COST_MS."""
    model = _tiny_model(bench)
    names = {id(model.w_qkv): "qkv", id(model.w_o): "o", id(model.w_gate_up): "gate_up",
             id(model.w_down): "down", id(model.lm_head): "lm_head"}  # fmt: skip
    linear, attention = model._linear, model._attention

    def costly_linear(x, w, poll, num_chunks):
        clock[0] += _COST_MS[names[id(w)]]
        return linear(x, w, poll, num_chunks)

    def costly_attention(q, poll, num_groups):
        clock[0] += _COST_MS["attn"]
        attention(q, poll, num_groups)

    model._linear, model._attention = costly_linear, costly_attention
    return model


def test_profiling_names_each_event_interval_by_its_operator(bench, fake_cuda_clock) -> None:
    """time_cold_ops: every interval lands under its operator, warm-up steps are dropped."""
    model = _costly_model(bench, fake_cuda_clock)
    samples = bench.time_cold_ops(model, num_warmup=1, num_steps=2)
    for name, ms in _COST_MS.items():
        per_step = 1 if name == "lm_head" else model.shape.num_layers
        assert samples[name] == pytest.approx([ms / 1e3] * per_step * 2)


def test_measured_times_take_k_n_step_and_the_extra_chunk(bench, fake_cuda_clock) -> None:
    """measure_profile_times on CPU: a poll costs 0.5 ms, so gate_up in 2 chunks (2 polls)
    costs 0.5 ms more than whole (1 poll); K and N come from the task-attention timings."""
    model = _costly_model(bench, fake_cuda_clock)

    def poll() -> None:
        fake_cuda_clock[0] += 0.5

    cfg = bench.run_config(bench.parse_args(["--quick"]))
    task_attention = {"one_block_per_item": {"median_us": 30.0}, "grid_132": {"median_us": 20.0}}
    times = bench.measure_profile_times(model, poll, 132, cfg, task_attention, [9.0, 10.0, 30.0])
    assert times.split_overhead_s == pytest.approx(0.5e-3)
    assert (times.local_attention_s, times.remote_attention_s) == pytest.approx((30e-6, 20e-6))
    assert times.step_s == pytest.approx(10e-3) and times.remote_attention_grid == 132
    assert len(times.op_samples_s["attn"]) == model.shape.num_layers * cfg.num_profile_steps


def test_poll_point_count_of_the_llama_shape(bench) -> None:
    model = object.__new__(bench.ColdModel)
    model.shape = bench.ColdShape()
    assert model.num_poll_points({}) == 32 * 5 + 1
    assert model.num_poll_points(bench.fixed_chunks(4)) == 32 * (3 + 2 * 4) + 4
    assert model.num_poll_points({"attn": 4, "lm_head": 8}) == 32 * (4 + 4) + 8
    with pytest.raises(ValueError, match="unknown cold operator"):
        model.num_poll_points({"mlp": 2})
    with pytest.raises(ValueError, match="int >= 1"):
        model.num_poll_points({"attn": 0})


def test_op_names_are_the_profile_names(bench) -> None:
    from weaver.splitting.profile import LM_HEAD_NAME, PER_LAYER_OP_NAMES

    assert bench.LAYER_OP_NAMES == PER_LAYER_OP_NAMES and bench.LM_HEAD_OP == LM_HEAD_NAME
    assert set(bench.split_dims(bench.ColdShape(), 128)) == set(bench.COLD_OP_NAMES)


def test_split_options_parse_and_reach_the_run_config(bench) -> None:
    from weaver.splitting.profile import DEFAULT_THRESHOLD_FRAC

    default = bench.run_config(bench.parse_args([]))
    assert (default.split_plan, default.threshold_frac) == ("planned", DEFAULT_THRESHOLD_FRAC)
    cfg = bench.run_config(bench.parse_args(["--split-plan", "fixed", "--threshold-frac",
                                             "0.01", "--split-chunks", "8"]))  # fmt: skip
    assert (cfg.split_plan, cfg.threshold_frac, cfg.split_chunks) == ("fixed", 0.01, 8)
    quick = bench.run_config(bench.parse_args(["--quick"]))
    assert quick.num_profile_steps < default.num_profile_steps


@pytest.mark.parametrize(
    "argv",
    [
        ["--split-plan", "auto"],
        ["--threshold-frac", "0"],
        ["--threshold-frac", "1"],
        ["--threshold-frac", "-0.1"],
        ["--threshold-frac", "nan"],
        ["--split-chunks", "33"],  # down's 4096 outputs hold 32 chunks of 128 columns
    ],
)
def test_bad_split_options_are_refused(bench, argv, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        bench.parse_args(argv)
    assert exc.value.code == 2 and "error:" in capsys.readouterr().err


def _times(bench, layer_op_s: float, lm_head_s: float, *, overhead_s: float = 2e-6):
    """Hand-made measurements of the Llama shape: every per-layer operator takes
    ``layer_op_s``, the hot iteration is the sum of the step."""
    samples = {name: [layer_op_s] * 4 for name in bench.LAYER_OP_NAMES}
    samples["lm_head"] = [lm_head_s] * 4
    step_s = 32 * 5 * layer_op_s + lm_head_s
    return bench.MeasuredTimes(op_samples_s=samples, local_attention_s=30e-6,
                               remote_attention_s=20e-6, remote_attention_grid=132,
                               step_s=step_s, split_overhead_s=overhead_s)  # fmt: skip


def _decide(bench, times, argv: list[str]):
    from weaver.splitting.profile import SplitProfile

    cfg = bench.run_config(bench.parse_args(argv))
    profile = bench.build_split_profile(times, bench.ColdShape(), cfg, "Test GPU")
    assert SplitProfile.model_validate(profile.model_dump()) == profile  # a valid profile
    return bench.decide_split(profile, cfg.split_plan, cfg.threshold_frac, cfg.split_chunks)


def test_plan_splits_a_dominant_lm_head(bench) -> None:
    decision = _decide(bench, _times(bench, 5e-6, 900e-6), ["--threshold-frac", "0.01"])
    profile, plan = decision.profile, decision.plan
    assert profile.device == "Test GPU" and "K: the standalone paged attention" in profile.notes
    assert profile.lm_head.split_dim_size == 128256 and profile.lm_head.min_chunk_size == 128
    assert {op.name: op.split_dim_size for op in profile.layer_ops}["attn"] == 128
    assert plan.chunks["lm_head"] > 1
    assert all(plan.chunks[name] == 1 for name in bench.LAYER_OP_NAMES)
    assert decision.chunks == plan.chunks and decision.splits_anything
    assert decision.wait_s == pytest.approx(plan.wait_after_s)
    assert plan.wait_after_s <= plan.threshold_s < plan.wait_before_s


def test_plan_that_splits_nothing_is_reported(bench, capsys) -> None:
    times = _times(bench, 5e-6, 5e-6)
    decision = _decide(bench, times, [])
    assert not decision.splits_anything
    assert set(decision.chunks.values()) == {1}
    assert decision.plan.stop_reason.value == "below_threshold"
    section = bench.split_plan_section(decision, times)
    assert section["splits_anything"] is False and section["mode"] == "planned"
    assert "splits nothing" in section["summary"] and "runs unsplit" in section["summary"]
    waits = section["expected_wait_us"]
    assert waits["unsplit"] == waits["receiver_c"] == pytest.approx(2.5)
    lines = bench.split_plan_lines(section)
    assert len(lines) <= 5 and "splits nothing" in lines[-1]
    assert "threshold 5.0% of the 0.805 ms hot iteration = 40.2 us" in lines[0]
    # the final table prints the plan from the saved JSON, before the receivers' rows
    results = {name: _entry(40.0, 12.0, 10.0, 10.0) for name in bench.RECEIVERS}
    report = bench.summarize(results, [10.0])
    report.update(gpu="Test GPU", receivers=results, split_plan=json.loads(json.dumps(section)))
    bench.print_table(report)
    table = capsys.readouterr().out
    assert table.index("splits nothing") < table.index("a: CPU-launched")


def test_split_section_round_trips_through_json(bench) -> None:
    from weaver.splitting.algorithm import SplitPlan
    from weaver.splitting.profile import SplitProfile

    times = _times(bench, 5e-6, 900e-6)
    decision = _decide(bench, times, ["--threshold-frac", "0.01"])
    section = json.loads(json.dumps(bench.split_plan_section(decision, times)))
    assert SplitProfile.model_validate(section["profile"]) == decision.profile
    assert SplitPlan.from_dict(section["plan"]) == decision.plan
    assert section["receiver_c_chunks"] == decision.chunks
    assert section["sum_of_op_means_ms"] == pytest.approx(section["hot_step_ms"])
    assert "receiver c runs the plan (lm_head" in bench.split_plan_lines(section)[-1]


def test_fixed_split_runs_its_chunks_and_reports_the_plan(bench) -> None:
    times = _times(bench, 5e-6, 900e-6)
    decision = _decide(bench, times, ["--split-plan", "fixed", "--threshold-frac", "0.01"])
    assert decision.chunks == {"qkv": 1, "attn": 1, "o": 1, "gate_up": 4, "down": 4,
                               "lm_head": 4}  # fmt: skip
    assert decision.plan.chunks["lm_head"] > 4  # the plan differs and is still reported
    assert decision.plan.wait_after_s < decision.wait_s < decision.plan.wait_before_s
    assert "fixed split" in bench.split_plan_section(decision, times)["summary"]


def test_negative_overhead_is_recorded_as_zero_and_noted(bench) -> None:
    decision = _decide(bench, _times(bench, 5e-6, 900e-6, overhead_s=-1.5e-6), [])
    assert decision.profile.split_overhead_s == 0.0
    assert "measured -1.50 us, below 0" in decision.profile.notes


def test_missing_operator_time_is_an_error(bench) -> None:
    times = _times(bench, 5e-6, 900e-6)
    times.op_samples_s["attn"] = []
    with pytest.raises(ValueError, match="no time for operator 'attn'"):
        _decide(bench, times, [])


def test_script_imports_and_says_so_without_pydantic(monkeypatch) -> None:
    """The GPU image has no pydantic unless carried: the script must still load, parse
    and name what is missing instead of failing on import."""
    monkeypatch.setitem(sys.modules, "pydantic", None)  # import pydantic -> ImportError
    monkeypatch.delitem(sys.modules, "weaver.splitting.profile", raising=False)
    module = _load("offload_wait_bench_no_pydantic")
    try:
        assert module.parse_args([]).threshold_frac == 0.05
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        assert "pydantic is missing" in module.unavailable_reason()
    finally:
        del sys.modules["offload_wait_bench_no_pydantic"]


def test_receivers_can_be_chosen_and_the_summary_judges_what_ran(bench) -> None:
    cfg = bench.run_config(bench.parse_args(["--receivers", "c_poll_split,b_poll_kernel"]))
    assert cfg.receivers == ("b_poll_kernel", "c_poll_split")  # in the benchmark's order
    with pytest.raises(SystemExit):
        bench.parse_args(["--receivers", "b_poll_kernel,z"])
    results = {"b_poll_kernel": _entry(30.0, 12.0, 10.0, 10.0),
               "c_poll_split": _entry(20.0, 12.0, 10.0, 10.0)}  # fmt: skip
    report = bench.summarize(results, [10.0])
    assert set(report["acceptance"]) == {"idle_round_trip_p99_us_b", "no_traffic_poll_overhead_b"}
    assert report["verdict"].startswith("PASS")
    assert bench.summarize({"c_poll_split": results["c_poll_split"]}, [10.0])["verdict"] == (
        "no verdict: receiver b did not run")


def test_the_armed_server_is_judged_on_its_own_targets(bench, capsys) -> None:
    """With receiver e, the verdict is e's: idle p99 <= 20 us, no busy wait over 1 ms, p99
    within the longest operator + the task, >= 10x below the paper's baseline p, <= 1 %
    with no traffic, no failed task; a / e is reported beside it."""
    e = _entry(200.0, 15.0, 10.05, 10.3)
    e["busy_wait_us"]["max"] = 400.0
    e["num_failed"] = {"busy": 0, "idle": 0}
    results = {"a_cpu_launched": _entry(600.0, 40.0, 10.0, 10.8),
               "p_cpu_behind_cold": _entry(50_000.0, 40.0, 10.0, 10.0),
               "b_poll_kernel": _entry(7000.0, 60.0, 10.2, 10.3),
               "e_armed_server": e}  # fmt: skip
    bound = {"longest_op": "lm_head", "longest_op_us": 350.0, "task_us": 150.0,
             "bound_us": 500.0}  # fmt: skip
    report = bench.summarize(results, [10.0] * 3, wait_bound_us=bound)
    acceptance = report["acceptance"]
    assert set(acceptance) == {
        "idle_round_trip_p99_us_e", "busy_max_wait_us_e",
        "busy_p99_us_e_within_longest_op_plus_task", "busy_p99_p_over_e",
        "no_traffic_overhead_e", "failed_tasks_e"}
    assert acceptance["busy_p99_p_over_e"]["value"] == pytest.approx(250.0)
    assert report["verdict"].startswith("PASS") and report["busy_p99_a_over_e"] == 3.0
    e["busy_wait_us"]["max"] = 1500.0  # one wait over 1 ms fails it
    e["no_traffic_step_ms"] = [10.2] * 5  # 2 %: over the 1 % target
    report = bench.summarize(results, [10.0] * 3, wait_bound_us=bound)
    assert report["verdict"] == "FAIL: busy_max_wait_us_e, no_traffic_overhead_e"
    report.update(gpu="Test GPU", receivers=results, baseline_step_ms_median=10.0)
    bench.print_table(report)
    assert "p: CPU, behind cold" in capsys.readouterr().out


def test_the_wait_bound_is_the_longest_operator_plus_the_task(bench) -> None:
    ops = [{"name": n, "mean_s": t} for n, t in (("qkv", 1e-4), ("down", 2e-4))]
    section = {"profile": {"layer_ops": ops, "lm_head": {"name": "lm_head", "mean_s": 3.5e-4}}}
    bound = bench.wait_bound_us(section, {"grid_132": {"median_us": 150.0}}, 132)
    assert bound["longest_op"] == "lm_head"
    assert bound["bound_us"] == pytest.approx(500.0)
