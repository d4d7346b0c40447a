"""Soak: trace-driven load on `weaver serve` for N minutes while its engines are killed.

Replays the Azure conversation trace (shipped with Weaver) against every model of the
deployment (the embedded default: a weaving pair), and kills an engine process at random
times (an EngineCore or its worker, of a random model that is in service). The gateway's
supervisor restarts each (weaver/server/supervisor.py). Reports, as JSON and a plot:

- requests completed, and failed with their reasons; a failure is *clean* when the client got
  an HTTP error with an OpenAI error body or an error event in its stream, *lost* otherwise
  (a dropped connection, a stream cut without a word, a hang past the client timeout);
- p50/p99 end-to-end latency of requests that overlapped a recovery window (kill -> back in
  service) and of those that did not;
- every kill with its recovery time, the restarts /metrics counted;
- what could grow, sampled every 2 s: the gateway's RSS, open fds and threads, the bytes in
  /dev/shm and vLLM's socket files (its VLLM_RPC_BASE_PATH); and /dev/shm and the socket
  files again once the server has stopped.

The verdict (the JSON's first key) passes when no request was lost, every engine came
back, the gateway's RSS after warm-up (from the first recovery on) ends within 5 % of where
it began, and /dev/shm and the socket files end as they were before the server started.

    python benchmarks/soak.py --minutes 10 --kills 6 --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import stat
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import psutil

from weaver.bench.loadgen import LoadGenConfig, run_load
from weaver.bench.prom_histogram import read_counter
from weaver.bench.server_process import RunningServer, weaver_server
from weaver.config.deployment import load_deployment
from weaver.workloads.builder import ModelLoad, WorkloadSpec, build_workload

API_KEY = "soak"


@dataclass
class Kill:
    at_s: float  # since the load started
    model: str
    process: str  # "engine core" or "worker"
    pid: int
    back_at_s: float | None = None  # when /health said the model was in service again

    @property
    def recovery_s(self) -> float | None:
        return None if self.back_at_s is None else self.back_at_s - self.at_s


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None,
                        help="deployment file (default: the embedded two-model deployment)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--kills", type=int, default=6, help="engine kills during the load")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, all "
                        "models together (Poisson arrivals, trace lengths)")
    parser.add_argument("--length-scale", type=float, default=0.1,
                        help="scale of the trace's prompt and output lengths (this machine "
                        "has two cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"),
                        help="folder for soak.json and soak.png")
    return parser.parse_args(argv)


def engine_processes(server: RunningServer, model: str) -> dict[str, psutil.Process]:
    status = server.health().json()["models"][model]
    core = psutil.Process(status["engine_pids"][0])
    workers = core.children()
    return {"engine core": core, **({"worker": workers[0]} if workers else {})}


def in_service(server: RunningServer) -> dict[str, int]:
    """Models in service now, with their restart counts."""
    try:
        models = server.health().json()["models"]
    except (httpx.HTTPError, ValueError):
        return {}
    return {name: m["restarts"] for name, m in models.items() if m["status"] == "ok"}


class Killer(threading.Thread):
    """Kills `num_kills` engine processes at random times within the load, one at a time:
    each waits for the last victim to be back in service."""

    def __init__(self, server: RunningServer, models: list[str], duration_s: float,
                 num_kills: int, rng: random.Random, start: float) -> None:
        super().__init__(daemon=True)
        self.server, self.models, self.rng, self.start_at = server, models, rng, start
        # Evenly spaced slots, a random instant in each, none in the last 10 %: a kill is
        # worth measuring only if its recovery falls inside the load.
        slot = 0.9 * duration_s / num_kills
        self.planned = sorted(i * slot + rng.uniform(0.1, 0.9) * slot for i in range(num_kills))
        self.kills: list[Kill] = []
        self.stop = threading.Event()

    def run(self) -> None:
        for planned in self.planned:
            if self.stop.wait(max(planned - self.now(), 0)):
                return
            model = self.rng.choice(self.models)
            before = in_service(self.server)
            while model not in before and not self.stop.wait(1):
                before = in_service(self.server)
            which, victim = self.rng.choice(sorted(engine_processes(self.server, model).items()))
            kill = Kill(self.now(), model, which, victim.pid)
            victim.kill()
            self.kills.append(kill)
            print(f"[{kill.at_s:6.0f} s] killed the {which} of {model} (pid {victim.pid})",
                  flush=True)
            while not self.stop.wait(0.5):
                restarts = in_service(self.server).get(model)
                if restarts is not None and restarts > before[model]:
                    kill.back_at_s = self.now()
                    print(f"[{kill.back_at_s:6.0f} s] {model} back after "
                          f"{kill.recovery_s:.1f} s", flush=True)
                    break

    def now(self) -> float:
        return time.monotonic() - self.start_at


MAX_RSS_GROWTH = 0.05  # of the gateway's RSS after warm-up, start to end


def shm_bytes() -> int:
    total = 0
    for entry in Path("/dev/shm").iterdir():
        with contextlib.suppress(OSError):
            total += entry.stat().st_size
    return total


def socket_files() -> int:
    """vLLM's ZeroMQ socket files under its base path (what libzmq leaves on close)."""
    base = Path(os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir())
    count = 0
    for path in base.rglob("*"):
        with contextlib.suppress(OSError):
            count += stat.S_ISSOCK(path.lstat().st_mode)
    return count


@dataclass
class Sample:
    at_s: float
    rss_mib: float
    fds: int
    threads: int
    shm_mib: float
    socket_files: int


def sample_resources(server: RunningServer, start: float, stop: threading.Event,
                     samples: list[Sample]) -> None:
    gateway = psutil.Process(server.process.pid)
    while not stop.wait(2.0):
        with contextlib.suppress(psutil.Error):
            samples.append(Sample(time.monotonic() - start, gateway.memory_info().rss / 2 ** 20,
                                  gateway.num_fds(), gateway.num_threads(),
                                  shm_bytes() / 2 ** 20, socket_files()))


def verdict(result: dict, samples: list[Sample]) -> tuple[str, dict]:
    """'pass' or 'fail: reasons', and the RSS comparison it read."""
    kills = result["kills"]
    warm_at = min((k["back_at_s"] for k in kills if k["back_at_s"] is not None),
                  default=samples[0].at_s if samples else 0.0)
    warm = [s.rss_mib for s in samples if s.at_s >= warm_at]
    # A minute's median at each end: one sample may catch a request's transient buffers.
    window = 30
    rss = {"warm_from_s": warm_at,
           "start_mib": statistics.median(warm[:window]) if warm else None,
           "end_mib": statistics.median(warm[-window:]) if warm else None}
    reasons = []
    if result["outcomes"]["lost"]:
        reasons.append(f"{result['outcomes']['lost']} requests lost")
    if any(k["back_at_s"] is None for k in kills):
        reasons.append("an engine did not come back")
    if any(m["status"] != "ok" for m in result["health_at_end"].values()):
        reasons.append(f"not every model in service at the end: {result['health_at_end']}")
    if rss["start_mib"] and rss["end_mib"] > (1 + MAX_RSS_GROWTH) * rss["start_mib"]:
        reasons.append(f"gateway RSS grew from {rss['start_mib']:.0f} to "
                       f"{rss['end_mib']:.0f} MiB after warm-up")
    left = result["left_after_stop"]
    if left["shm_bytes"] > left["shm_bytes_before"]:
        reasons.append(f"/dev/shm holds {left['shm_bytes'] - left['shm_bytes_before']} bytes "
                       "more than before the server started")
    if left["socket_files"] > left["socket_files_before"]:
        reasons.append(f"{left['socket_files'] - left['socket_files_before']} socket files "
                       "more than before the server started")
    return ("pass" if not reasons else "fail: " + "; ".join(reasons)), rss


def classify(error: str | None) -> str:
    """'clean' when the client was told (an HTTP error with a body, an error event)."""
    if error is None:
        return "ok"
    if error.startswith("RuntimeError: HTTP ") and '"error"' in error:
        return "clean"
    if error.startswith("RuntimeError: server error in stream"):
        return "clean"
    return "lost"


def percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50_s": None, "p99_s": None}
    ordered = sorted(values)
    return {"n": len(values), "p50_s": statistics.median(ordered),
            "p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]}


def summarize(records: list, kills: list[Kill]) -> dict:
    windows = [(k.at_s, k.back_at_s if k.back_at_s is not None else float("inf"))
               for k in kills]
    outcomes: dict[str, int] = {"ok": 0, "clean": 0, "lost": 0, "not_sent": 0}
    reasons: dict[str, int] = {}
    during, outside = [], []
    for record in records:
        if record.sent_at_s is None:
            outcomes["not_sent"] += 1
            continue
        kind = classify(record.error) if record.status.value in ("ok", "error") else "lost"
        outcomes[kind] += 1
        if record.error:
            reason = record.error.split(":", 2)[-1].strip()[:100]
            reasons[reason] = reasons.get(reason, 0) + 1
        if kind != "ok" or record.e2e_s is None:
            continue
        end = record.sent_at_s + record.e2e_s
        overlaps = any(start <= end and record.sent_at_s <= back for start, back in windows)
        (during if overlaps else outside).append(record.e2e_s)
    return {"outcomes": outcomes, "failure_reasons": reasons,
            "latency_during_recovery": percentiles(during),
            "latency_outside_recovery": percentiles(outside)}


def plot(result: dict, records: list, out_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_latency, ax_rss, ax_files) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for kill in result["kills"]:
        back = kill["back_at_s"] if kill["back_at_s"] is not None else kill["at_s"] + 5
        for ax in (ax_latency, ax_rss, ax_files):
            ax.axvspan(kill["at_s"], back, color="tab:red", alpha=0.15)
    for kind, color in (("ok", "tab:blue"), ("clean", "tab:orange"), ("lost", "black")):
        points = [(r.sent_at_s, r.e2e_s or 0.0) for r in records
                  if r.sent_at_s is not None and classify(r.error) == kind]
        if points:
            ax_latency.scatter(*zip(*points, strict=True), s=6, color=color,
                               label=f"{kind} ({len(points)})")
    ax_latency.set_ylabel("end-to-end latency (s)")
    ax_latency.legend(loc="upper right")
    ax_latency.set_title("Soak: requests over time; red bands are kill -> back in service")
    samples = result["samples"]
    times = [s["at_s"] for s in samples]
    ax_rss.plot(times, [s["rss_mib"] for s in samples], color="tab:green")
    ax_rss.set_ylabel("gateway RSS (MiB)")
    ax_rss.set_title(result["verdict"], fontsize=9)
    ax_files.plot(times, [s["fds"] for s in samples], label="gateway fds")
    ax_files.plot(times, [s["threads"] for s in samples], label="gateway threads")
    ax_files.plot(times, [s["socket_files"] for s in samples], label="vLLM socket files")
    ax_shm = ax_files.twinx()
    ax_shm.plot(times, [s["shm_mib"] for s in samples], color="tab:purple", linestyle="--",
                label="/dev/shm (MiB, right)")
    ax_files.set_ylabel("count")
    ax_shm.set_ylabel("/dev/shm (MiB)")
    handles = ax_files.get_legend_handles_labels()[0] + ax_shm.get_legend_handles_labels()[0]
    ax_files.legend(handles=handles, loc="upper left", fontsize=8)
    ax_files.set_xlabel("time since the load started (s)")
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    deployment = load_deployment(args.config)
    models = [spec.name for spec in deployment.models]
    duration_s = args.minutes * 60
    spec = WorkloadSpec(models=[ModelLoad(m) for m in models], rate=args.rate,
                        num_requests=max(1, int(args.rate * duration_s)),
                        length_scale=args.length_scale,
                        max_model_len=min(s.max_model_len for s in deployment.models),
                        seed=args.seed)
    requests = build_workload(spec)
    args.out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    shm_before, sockets_before = shm_bytes(), socket_files()
    with tempfile.TemporaryDirectory() as tmp, \
            weaver_server(args.config, Path(tmp) / "serve.log", "--api-key", API_KEY) as server:
        config = LoadGenConfig(base_url=server.base_url, api_key=API_KEY,
                               duration_s=duration_s + 120, request_timeout_s=300,
                               show_progress=True)
        start = time.monotonic()
        killer = Killer(server, models, duration_s, args.kills, rng, start)
        samples: list[Sample] = []
        stop_sampling = threading.Event()
        sampler = threading.Thread(target=sample_resources,
                                   args=(server, start, stop_sampling, samples), daemon=True)
        killer.start()
        sampler.start()
        outcome = asyncio.run(run_load(requests, config))
        killer.stop.set()
        killer.join()
        # Every victim back? (a restart still under way when the load ended gets a minute)
        deadline = time.monotonic() + 60
        while any(k.back_at_s is None for k in killer.kills) and time.monotonic() < deadline:
            time.sleep(1)
            for kill in killer.kills:
                if kill.back_at_s is None and kill.model in in_service(server):
                    kill.back_at_s = time.monotonic() - start
        stop_sampling.set()
        sampler.join()
        metrics = httpx.get(f"{server.base_url}/metrics", timeout=30).text
        restarts = {m: read_counter(metrics, "weaver_engine_restarts", {"model": m}) or 0
                    for m in models}
        health = server.health().json()
    left_after_stop = {"shm_bytes_before": shm_before, "shm_bytes": shm_bytes(),
                       "socket_files_before": sockets_before, "socket_files": socket_files()}
    result = {
        "verdict": None,
        "benchmark": "soak",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else
                                                       sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": psutil.cpu_count()},
        "minutes": args.minutes, "rate": args.rate, "length_scale": args.length_scale,
        "num_requests": len(requests),
        **summarize(outcome.records, killer.kills),
        "kills": [{**asdict(k), "recovery_s": k.recovery_s} for k in killer.kills],
        "restarts": restarts,
        "health_at_end": {name: {"status": m["status"], "restarts": m["restarts"]}
                          for name, m in health["models"].items()},
        "left_after_stop": left_after_stop,
        "samples": [asdict(sample) for sample in samples],
    }
    result["verdict"], result["gateway_rss_after_warmup"] = verdict(result, samples)
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, outcome.records, args.out / "soak.png")
    print(json.dumps({k: result[k] for k in ("verdict", "outcomes", "latency_during_recovery",
                                             "latency_outside_recovery", "restarts",
                                             "health_at_end", "gateway_rss_after_warmup",
                                             "left_after_stop")}, indent=1))
    print(f"kills: {[(k.model, k.process, k.recovery_s) for k in killer.kills]}")
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
