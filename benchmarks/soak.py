"""Soak: trace-driven load on `weaver serve` for N minutes while its engines are killed and the
whole server is restarted; optionally, the same kinds of engine under plain `vllm serve`.

Replays the Azure conversation trace (shipped with Weaver) against every model clients see
(`--deployment`; default: the embedded weaving pair; benchmarks/deployments/
soak_every_kind.yaml holds one engine of every kind). While it runs:

- `--kills N` SIGKILLs, at evenly spread random times, each to one process of one engine,
  the roles taken in turn: every (engine, EngineCore or worker) once in a shuffled order,
  then again (soak_kit/engines.py); the supervisor restarts the engine
  (weaver/server/supervisor.py), and the next kill waits until it is back;
- `--server-restarts N` SIGTERM/restart cycles of the whole `weaver serve` at even times,
  on the same port (never during a kill's recovery); the load does not pause: a request
  sent while the server is down meets a refused connection and counts as `server_down`,
  apart from clean errors and from lost requests (soak_kit/outcomes.py);
- every 2 s: the gateway's RSS, fds and threads, the /dev/shm the server's processes map,
  vLLM's socket files, each weaving pair's status in /health (soak_kit/watch.py).
After the load the pairs get `--settle-s` (2 minutes) to be `ok` again by themselves, then the
server gets SIGTERM, and what it left in /dev/shm and as socket files is counted before
anything is cleaned up. `--plain-vllm` then runs soak_kit/plain_vllm.py: a weaving pair and
a mux group's two members as plain `vllm serve` servers, loaded, restarted, the cold one
crashed, all stopped, and /dev/shm checked again.

Outcomes: ok; clean (an HTTP error with an OpenAI error body, with Retry-After for 429 and
503, or an error event in the stream); no_retry_after (a 429/503 without it); server_down
(connection refused during a server restart); lost (anything else: a dropped connection,
a stream cut without a word, a hang past the client timeout).

The verdict (the JSON's first key; soak_kit/verdict.py) passes when no request was lost or
answered 429/503 without Retry-After, every engine came back after each kill and the
server after each restart, every engine and every weaving pair is `ok` at the end, the
gateway's RSS after warm-up ends each life within 5 % of where it began, no process
outlived a stop and /dev/shm and the socket files hold nothing new after every stop
(the plain phase's too). Results: soak.json and soak.png in --out.

    python benchmarks/soak.py --deployment benchmarks/deployments/soak_every_kind.yaml \\
        --minutes 60 --kills 30 --server-restarts 2 --plain-vllm --out benchmarks/results/soak
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import platform
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.soak_kit.engines import (  # noqa: E402
    engines_of,
    in_service,
    kill_order,
    not_killed,
    pair_statuses,
)
from benchmarks.soak_kit.killer import Kill, Killer, health_of, kill_plan  # noqa: E402
from benchmarks.soak_kit.outcomes import (  # noqa: E402
    classify,
    outcome_of,
    outcomes_per_minute,
    summarize,
)
from benchmarks.soak_kit.plot import plot  # noqa: E402
from benchmarks.soak_kit.server import ServerLives, restart  # noqa: E402
from benchmarks.soak_kit.verdict import MAX_RSS_GROWTH, Sample, verdict  # noqa: E402
from benchmarks.soak_kit.watch import Sampler, ShmLedger  # noqa: E402
from weaver.bench.loadgen import LoadGenConfig, run_load  # noqa: E402
from weaver.config.deployment import Deployment, load_deployment  # noqa: E402
from weaver.workloads.builder import ModelLoad, WorkloadSpec, build_workload  # noqa: E402

# Re-exported for tests/bench/test_soak_verdict.py (the script is its entry point).
__all__ = ["MAX_RSS_GROWTH", "Kill", "Sample", "classify", "main", "verdict"]

API_KEY = "soak"
POLL_S = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployment", "--config", dest="deployment", type=Path,
                        default=None, help="deployment file (default: the embedded "
                        "two-model deployment)")
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the load")
    parser.add_argument("--kills", type=int, default=6, help="engine kills during the load")
    parser.add_argument("--server-restarts", type=int, default=0,
                        help="SIGTERM/restart cycles of the whole weaver serve, at even times")
    parser.add_argument("--settle-s", type=float, default=120.0,
                        help="after the load, how long the last victim gets to be back and "
                        "every engine and weaving pair to be ok by themselves")
    parser.add_argument("--plain-vllm", action="store_true",
                        help="afterwards, the plain `vllm serve` phase (soak_kit/plain_vllm.py)")
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second, all "
                        "models together (Poisson arrivals, trace lengths)")
    parser.add_argument("--length-scale", type=float, default=0.1,
                        help="scale of the trace's prompt and output lengths (this machine "
                        "has two cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/soak"),
                        help="folder for soak.json and soak.png")
    return parser.parse_args(argv)


def build_requests(deployment: Deployment, args: argparse.Namespace) -> list:
    """The trace's requests over every model clients send (a phase split's own name, not
    its engines')."""
    duration_s = args.minutes * 60
    spec = WorkloadSpec(models=[ModelLoad(m) for m in deployment.served_names], rate=args.rate,
                        num_requests=max(1, int(args.rate * duration_s)),
                        length_scale=args.length_scale,
                        max_model_len=min(s.max_model_len for s in deployment.models),
                        seed=args.seed)
    return build_workload(spec)


def restart_times(duration_s: float, num_restarts: int) -> list[float]:
    return [duration_s * (i + 1) / (num_restarts + 1) for i in range(num_restarts)]


class LoadThread(threading.Thread):
    """The load generator on its own event loop, so that the main thread can start and stop
    servers (a server dies with the thread that started it: server_process.py)."""

    def __init__(self, requests: list, config: LoadGenConfig) -> None:
        super().__init__(daemon=True, name="soak-load")
        self.requests, self.config = requests, config
        self.records: list = []
        self.done = threading.Event()

    def run(self) -> None:
        try:
            self.records = asyncio.run(run_load(self.requests, self.config)).records
        finally:
            self.done.set()


def settle(lives: ServerLives, killer: Killer, limit_s: float) -> float:
    """After the load: wait (at most `limit_s`) for the last victim to be back and for
    every engine and weaving pair to be ok, unaided; returns the seconds it took."""
    began = time.monotonic()
    while time.monotonic() - began < limit_s and lives.server is not None:
        for kill in killer.kills:
            if kill.back_at_s is None:
                killer.is_back(kill)
        health = health_of(lives.current_url())
        if not health:
            time.sleep(POLL_S)
            continue
        engines_ok = set(in_service(health)) == set(engines_of(health))
        pairs_ok = all(s == "ok" for s in pair_statuses(health).values())
        if engines_ok and pairs_ok and all(k.back_at_s is not None for k in killer.kills):
            break
        time.sleep(POLL_S)
    return time.monotonic() - began


def soak_weaver_serve(args: argparse.Namespace, requests: list, work_dir: Path) -> dict:
    """The load, the kills and the restarts against `weaver serve`; the result but its
    verdict. Each life's log goes to --out as life<N>.serve.log (not committed)."""
    duration_s = args.minutes * 60
    rng = random.Random(args.seed)
    rpc_base = work_dir / "rpc"
    rpc_base.mkdir()
    ledger = ShmLedger()
    lives = ServerLives(args.deployment, API_KEY, args.out, rpc_base, ledger)
    lives.start()
    try:
        engines = sorted(engines_of(lives.health()))
        start = time.monotonic()
        lock = threading.Lock()
        killer = Killer(lives.current_url, kill_plan(duration_s, kill_order(
            engines, args.kills, rng), rng), start, lock)
        sampler = Sampler(lives.current, start, ledger, rpc_base)
        load = LoadThread(requests, LoadGenConfig(
            base_url=lives.base_url, api_key=API_KEY, duration_s=duration_s + 120,
            request_timeout_s=300, show_progress=False))
        for thread in (load, killer, sampler):
            thread.start()
        cycles, left_after_restarts = [], []
        for at_s in restart_times(duration_s, args.server_restarts):
            if load.done.wait(max(at_s - (time.monotonic() - start), 0)):
                break
            with lock:  # not during a kill's recovery
                cycle, left = restart(lives, start)
            cycles.append(cycle)
            left_after_restarts.append(left)
            if cycle.back_at_s is None:
                break
        load.join()
        killer.stop.set()
        killer.join()
        settle_s = settle(lives, killer, args.settle_s)
        sampler.stop.set()
        sampler.join()
        health = health_of(lives.current_url()) or {}
    finally:
        code, survivors = lives.stop()
    left = ledger.left(rpc_base, survivors)
    removed = ledger.clean_up()
    down = [(c.at_s, c.back_at_s if c.back_at_s is not None else math.inf) for c in cycles]
    recoveries = [(k.at_s, k.back_at_s if k.back_at_s is not None else math.inf)
                  for k in killer.kills]
    records = load.records
    return {
        **summarize(records, recoveries, down),
        "outcomes_per_minute": outcomes_per_minute(
            (r.sent_at_s, outcome_of(r, down)) for r in records if r.sent_at_s is not None),
        "engines": engines, "num_roles": 2 * len(engines),
        "kills": [k.to_json() for k in killer.kills], "kills_skipped": killer.skipped,
        "roles_not_killed": [list(role) for role in not_killed(
            engines, [k.to_json() for k in killer.kills])],
        "server_restarts": [c.to_json() for c in cycles],
        "left_after_restarts": left_after_restarts,
        "engine_restarts": lives.engine_restarts,
        "settled_after_load_s": settle_s,
        "health_at_end": {name: {"status": e.get("status"), "restarts": e.get("restarts")}
                          for name, e in engines_of(health).items()},
        "pairs_at_end": pair_statuses(health),
        "final_stop": {"exit_code": code},
        "left_after_stop": left, "removed_after_counting": removed,
        "samples": [asdict(s) for s in sampler.samples],
        "pair_samples": [asdict(p) for p in sampler.pairs],
        "_samples": sampler.samples,
    }


def stop_on_sigterm() -> None:
    """SIGTERM (e.g. `timeout`) unwinds like Ctrl-C, so the server is stopped and counted."""
    def interrupt(_signum, _frame) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    stop_on_sigterm()
    deployment = load_deployment(args.deployment)
    requests = build_requests(deployment, args)
    args.out.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        run = soak_weaver_serve(args, requests, Path(tmp))
        plain = None
        if args.plain_vllm:
            from benchmarks.soak_kit.plain_vllm import PlainPhase

            (Path(tmp) / "plain").mkdir()
            plain = PlainPhase(Path(tmp) / "plain", args.out).run()
    samples: list[Sample] = run.pop("_samples")
    result: dict[str, Any] = {
        "verdict": None,
        "benchmark": "soak",
        "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else
                                                       sys.argv[1:])]),
        "machine": {"platform": platform.platform(), "cpus": psutil.cpu_count()},
        "deployment": str(args.deployment) if args.deployment else "embedded default",
        "minutes": args.minutes, "rate": args.rate, "length_scale": args.length_scale,
        "num_requests": len(requests), "wall_s": None,
        **run, "plain_vllm": plain,
    }
    result["verdict"], result["gateway_rss_after_warmup"] = verdict(result, samples)
    result["wall_s"] = time.monotonic() - began
    (args.out / "soak.json").write_text(json.dumps(result, indent=1))
    plot(result, args.out / "soak.png")
    print(json.dumps({k: result[k] for k in (
        "verdict", "outcomes", "kills", "server_restarts", "settled_after_load_s",
        "health_at_end", "pairs_at_end", "gateway_rss_after_warmup", "left_after_stop",
        "wall_s")}, indent=1))
    print(f"wrote {args.out / 'soak.json'} and {args.out / 'soak.png'}")
    return 0 if result["verdict"] == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
