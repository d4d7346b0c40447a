"""Weaver on a local multi-node Ray cluster: `weaver cluster up` end to end, on one machine.

Starts a Ray cluster of a head node and one node per group of the cluster file (Ray's own
test facility, ray.cluster_utils.Cluster: separate raylets, each with the CPUs its group
asks for), deploys the file with the real `weaver cluster up` command, and then, through
the one endpoint and the official `openai` client:
  1. lists /v1/models (every model of every group);
  2. asks every model for a greedy completion, and one model for a streamed chat;
  3. checks each group's replica is on its own node;
  4. SIGKILLs one group's `weaver serve` and measures how long its models answer 503
     before Ray Serve has restarted the group and they answer again;
  5. `weaver cluster down`.
Writes a JSON of what it saw (--out) and exits 0 only if every step held.

    python benchmarks/cluster_local.py                      # benchmarks/cluster/cluster.yaml
    python benchmarks/cluster_local.py --out benchmarks/results/cluster/local_two_nodes.json

Needs the `ray` extra (pip install -e '.[ray]') and the models of the cluster's
deployments prepared (weaver models prepare). About 5 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CLUSTER = REPO / "benchmarks" / "cluster" / "cluster.yaml"
APP = "weaver-local"
RECOVERY_TIMEOUT_S = 600.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", type=Path, default=DEFAULT_CLUSTER,
                        help="the cluster file (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8765, help="the endpoint's port")
    parser.add_argument("--kill-group", help="the group whose server is killed (default: "
                        "the first)")
    parser.add_argument("--out", type=Path, help="write what was seen here as JSON")
    return parser.parse_args(argv)


def step(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def start_ray(groups: list[Any]) -> Any:
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    for group in groups:
        cpus = int(group.resources.get("CPU", 1)) * group.replicas
        cluster.add_node(num_cpus=cpus, resources={f"node_{group.name}": 1})
    cluster.wait_for_nodes()
    return cluster


def ask_every_model(base_url: str, models: list[str]) -> dict[str, str]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    answers = {}
    for model in models:
        done = client.completions.create(model=model, prompt="The capital of France is",
                                         max_tokens=8, temperature=0)  # fmt: skip
        answers[model] = done.choices[0].text
    return answers


def stream_chat(base_url: str, model: str) -> list[str]:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=300)
    chunks = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Count to five."}], max_tokens=16,
        temperature=0, stream=True)  # fmt: skip
    return [c.choices[0].delta.content or "" for c in chunks if c.choices]


def replica_nodes(app: str) -> dict[str, list[str]]:
    """group -> the node ids its replicas run on (Ray's state API)."""
    from ray.util.state import list_actors

    nodes: dict[str, list[str]] = {}
    for actor in list_actors(filters=[("state", "=", "ALIVE")], limit=1000):
        name = actor.class_name or ""
        prefix = f"ServeReplica:{app}:"
        if name.startswith(prefix):
            nodes.setdefault(name.removeprefix(prefix), []).append(actor.node_id)
    return nodes


def wait_answering(base_url: str, model: str, timeout_s: float) -> tuple[float, list[int]]:
    """Seconds until `model` answers a completion again, and the statuses seen before."""
    start, statuses = time.monotonic(), []
    while time.monotonic() - start < timeout_s:
        try:
            response = httpx.post(f"{base_url}/completions", timeout=120, json={
                "model": model, "prompt": "Hi", "max_tokens": 2, "temperature": 0})
            statuses.append(response.status_code)
            if response.status_code == 200:
                return time.monotonic() - start, statuses
        except httpx.HTTPError as exc:
            statuses.append(-1)
            step(f"  {model}: {type(exc).__name__}")
        time.sleep(2.0)
    raise TimeoutError(f"{model} did not answer within {timeout_s:.0f} s: {statuses[-10:]}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import ray
    from ray import serve

    from weaver.cluster.spec import load_cluster

    cluster_file = load_cluster(args.cluster)
    spec = cluster_file.spec
    # A copy of the cluster file for this machine: the endpoint on its own port, and
    # Ray Serve's HTTP proxy on the head only (every "node" here shares the machine's
    # ports). The copy sits beside the original: its deployments are found the same way.
    data = yaml.safe_load(args.cluster.read_text())
    data.setdefault("ingress", {}).update(port=args.port, proxy_location="HeadOnly")
    local = args.cluster.parent / f".{args.cluster.stem}_local.yaml"
    local.write_text(yaml.safe_dump(data, sort_keys=False))
    base_url = f"http://127.0.0.1:{args.port}/v1"
    seen: dict[str, Any] = {"cluster_file": _shown(args.cluster),
                            "groups": {g.name: cluster_file.models_of(g.name)
                                       for g in spec.groups}}  # fmt: skip
    step(f"starting a Ray cluster: a head and {len(spec.groups)} node(s)")
    ray_cluster = start_ray(spec.groups)
    try:
        env = {**os.environ, "RAY_ADDRESS": ray_cluster.address}
        step(f"weaver cluster up {args.cluster}")
        start = time.monotonic()
        up = subprocess.run([sys.executable, "-m", "weaver.cli.main", "cluster", "up",
                             str(local), "--address", ray_cluster.address, "--name", APP],
                            env=env, capture_output=True, text=True, timeout=1800)  # fmt: skip
        seen["cluster_up"] = {"exit_code": up.returncode, "seconds": time.monotonic() - start,
                              "stdout": up.stdout[-2000:], "stderr": up.stderr[-4000:]}
        if up.returncode != 0:
            raise RuntimeError(f"weaver cluster up failed: {up.stderr[-4000:]}")
        step(up.stdout.strip().splitlines()[-1])
        listed = httpx.get(f"{base_url}/models", timeout=30).json()
        seen["models_listed"] = sorted(m["id"] for m in listed["data"])
        expected = sorted(cluster_file.groups_of())
        step(f"/v1/models: {seen['models_listed']}")
        seen["answers"] = ask_every_model(base_url, expected)
        step(f"every model answered: {seen['answers']}")
        seen["streamed_chunks"] = stream_chat(base_url, expected[0])
        step(f"{expected[0]} streamed {len(seen['streamed_chunks'])} chunks")
        ray.init(address=ray_cluster.address, namespace="weaver", ignore_reinit_error=True)
        nodes = replica_nodes(APP)
        seen["replica_nodes"] = nodes
        group = args.kill_group or spec.groups[0].name
        handle = serve.get_deployment_handle(group, app_name=APP)
        pid = handle.server_pid.remote().result()
        model = cluster_file.models_of(group)[0]
        step(f"SIGKILL of group {group}'s weaver serve (pid {pid}); waiting for {model}")
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        recovery_s, statuses = wait_answering(base_url, model, RECOVERY_TIMEOUT_S)
        seen["kill"] = {"group": group, "pid": pid, "model": model,
                        "seconds_until_it_answered": recovery_s,
                        "statuses_before": statuses,
                        "new_pid": handle.server_pid.remote().result()}  # fmt: skip
        step(f"{model} answered again {time.monotonic() - killed_at:.0f} s after the kill "
             f"(statuses before: {sorted(set(statuses))})")
        seen["answers_after_kill"] = ask_every_model(base_url, expected)
        down = subprocess.run([sys.executable, "-m", "weaver.cli.main", "cluster", "down",
                               "--address", ray_cluster.address, "--name", APP],
                              env=env, capture_output=True, text=True, timeout=600)  # fmt: skip
        seen["cluster_down_exit_code"] = down.returncode
        step("weaver cluster down")
        failures = []
        if seen["models_listed"] != expected:
            failures.append(f"/v1/models listed {seen['models_listed']}, not {expected}")
        if len({n for ids in nodes.values() for n in ids}) < len(spec.groups):
            failures.append(f"groups share nodes: {nodes}")
        if seen["kill"]["new_pid"] == pid:
            failures.append("the killed group's server was not restarted")
        if down.returncode != 0:
            failures.append(f"weaver cluster down failed: {down.stderr[-1000:]}")
        seen["failures"] = failures
        seen["ok"] = not failures
        return seen
    finally:
        local.unlink(missing_ok=True)
        ray.shutdown()
        ray_cluster.shutdown()


def _shown(path: Path) -> str:
    """A path as the repository names it, when it is inside."""
    path = path.resolve()
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import ray  # noqa: F401
    except ImportError:
        print("cannot run: Ray is not installed (pip install -e '.[ray]')", file=sys.stderr)
        return 2
    seen = run(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(seen, indent=1))
    for failure in seen["failures"]:
        print(f"FAILED: {failure}", file=sys.stderr)
    print("ok" if seen["ok"] else "FAILED")
    return 0 if seen["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
