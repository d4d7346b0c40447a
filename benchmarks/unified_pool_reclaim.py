"""Cold load rising from 0 to saturation while the hot model weaves through the unified pool.

The unified pool's scripted run. One `weaver serve` runs four engines:

- `hot`: SmolLM2, every sequence remote: its KV lives in the cold device's unified pool;
- `cold`: tiny-llama-c with `unified_kv`: its own KV and what it lends in one pool of
  --own-gib + --lend-gib; the allocator moves quota by ADBS and reclaims for the cold model;
- `ref` and `cold-ref`: the same models dedicated; `cold-ref` owns the pool's whole size.

Both phases run the same hot load (--hot-streams clients sending long requests back to
back) and step the same cold load through --levels concurrent streams, --phase-s seconds
each; cold engines are pinned to core 1, SmolLM2 engines to core 0:

1. dedicated deployment: the hot load on `ref`, the cold load on `cold-ref`;
2. weaving: the hot load on `hot` (it fills the idle cold model's pool first), the cold
   load on `cold`, which takes its memory back.

So the two phases differ only in weaving and the pool, not in how busy the machine is.
Prints the cold output tok/s per level, over the whole level and over its second half (once
the pool has moved memory back), weaving over dedicated (target: >= 0.9 at the last,
saturating level, once recovered), the hot output tok/s, the hot tenant's share of the
pool before and after, reclaims and remote requests preempted, and checks that every hot
and cold request completed with the greedy tokens of a dedicated engine (from a reference
pass first).
Writes JSON (and a PNG of the pool share over time).

    python benchmarks/unified_pool_reclaim.py --out benchmarks/results/unified_pool_reclaim.json
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai

from weaver.bench.server_process import weaver_server
from weaver.models.registry import prepare_model

DEPLOYMENT = """
models:
  - name: ref
    role: dedicated{smollm2}
  - name: hot
    role: hot{smollm2}
  - name: cold-ref
    role: dedicated{tiny}
    kv_cache_gib: {total_gib}
  - name: cold
    role: cold{tiny}
    kv_cache_gib: {own_gib}
    lend_kv_gib: {lend_gib}
    unified_kv: true
weaving:
  - {{hot: hot, cold: [cold], offload_ratio: 1.0, timeout_s: 30.0}}
"""
SMOLLM2_ENGINE = """
    model: {path}
    kv_cache_gib: 0.25
    max_model_len: 512
    block_size: 64
    num_gpu_blocks_override: 9
    max_num_seqs: 64
    cpu_cores: '0'"""
TINY_ENGINE = """
    model: {path}
    max_model_len: 512
    block_size: 32
    max_num_seqs: 64
    cpu_cores: '1'"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--levels", type=int, nargs="+", default=[1, 4, 16],
                        help="cold concurrent streams per phase step (default: 1 4 16)")
    parser.add_argument("--phase-s", type=float, default=30.0,
                        help="seconds per cold level (default: 30)")
    parser.add_argument("--hot-streams", type=int, default=16,
                        help="hot clients sending long requests back to back (default: 16)")
    parser.add_argument("--hot-tokens", type=int, default=64,
                        help="output tokens per hot request (default: 64)")
    parser.add_argument("--cold-tokens", type=int, default=32,
                        help="output tokens per cold request (default: 32)")
    parser.add_argument("--own-gib", type=float, default=0.02,
                        help="the cold model's own KV, GiB (default: 0.02)")
    parser.add_argument("--lend-gib", type=float, default=0.02,
                        help="what the cold model lends, GiB (default: 0.02)")
    parser.add_argument("--out", type=Path, default=None, help="JSON results (and a PNG)")
    args = parser.parse_args(argv)
    if min(args.levels) < 1 or args.phase_s <= 0 or args.hot_streams < 1:
        parser.error("levels must be >= 1, --phase-s > 0 and --hot-streams >= 1")
    return args


def make_prompts(num: int, offset: int = 0) -> list[str]:
    """Mixed lengths, a few tokens to ~300."""
    topics = ["the ocean", "volcanoes", "the moon", "bread", "chess", "rivers", "owls"]
    return [f"Write a short note about {topics[i % 7]}."
            + f" Here is more context about {topics[i % 7]}." * (((i + offset) * 7) % 40)
            + f" Note {i}:" for i in range(num)]


class Client:
    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.openai = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused",
                                    max_retries=0, timeout=900)

    def complete(self, model: str, prompt: str, max_tokens: int) -> tuple[str, int]:
        reply = self.openai.completions.create(model=model, prompt=prompt,
                                               max_tokens=max_tokens, temperature=0,
                                               extra_body={"ignore_eos": True})
        return reply.choices[0].text, reply.usage.completion_tokens

    def complete_all(self, model: str, prompts: list[str], max_tokens: int) -> list[str]:
        with cf.ThreadPoolExecutor(len(prompts)) as pool:
            return [text for text, _ in pool.map(
                lambda p: self.complete(model, p, max_tokens), prompts)]

    def pool_stats(self) -> dict[str, float]:
        """The hot tenant's pages, the pool's size and the reclaim counters."""
        out = {"hot_pages": 0.0, "size": 0.0, "reclaims": 0.0, "preemptions": 0.0}
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        for line in text.splitlines():
            value = line.split()[-1] if line and not line.startswith("#") else None
            if value is None:
                continue
            if line.startswith("weaver_kv_pool_pages{") and 'tenant="hot"' in line:
                out["hot_pages"] += float(value)
            elif line.startswith("weaver_kv_pool_size_pages{"):
                out["size"] += float(value)
            elif line.startswith("weaver_kv_pool_reclaims_total{"):
                out["reclaims"] += float(value)
            elif line.startswith("weaver_kv_pool_reclaim_preemptions_total{"):
                out["preemptions"] += float(value)
        return out


class Streams:
    """`num` clients sending requests back to back (prompt i of stream s: (s * 7 + k) mod n)
    until stopped; every output is kept by prompt, and the tokens of requests finished in a
    window can be counted."""

    def __init__(self, client: Client, model: str, prompts: list[str], num: int,
                 max_tokens: int) -> None:
        self.client, self.model, self.prompts, self.max_tokens = client, model, prompts, max_tokens
        self.outputs: dict[int, set[str]] = {}
        self.finished: list[tuple[float, int]] = []  # (monotonic time, output tokens)
        self._stop = threading.Event()
        self._pool = cf.ThreadPoolExecutor(num)
        self._futures = [self._pool.submit(self._run, index) for index in range(num)]

    def _run(self, index: int) -> int:
        k = 0
        while not self._stop.is_set():
            prompt_index = (index * 7 + k) % len(self.prompts)
            text, num = self.client.complete(self.model, self.prompts[prompt_index],
                                             self.max_tokens)
            self.outputs.setdefault(prompt_index, set()).add(text)
            self.finished.append((time.monotonic(), num))
            k += 1
        return k

    def tok_s(self, start: float, end: float) -> float:
        return sum(n for t, n in self.finished if start <= t <= end) / (end - start)

    def stop(self) -> int:
        """Stop sending; wait for the requests in flight; return how many were sent."""
        self._stop.set()
        sent = sum(f.result() for f in self._futures)
        self._pool.shutdown()
        return sent


def cold_levels(client: Client, model: str, prompts: list[str], args: argparse.Namespace,
                outputs: dict[int, set[str]], timeline: list, t0: float,
                hot: Streams) -> dict[str, dict[int, float]]:
    """The cold load stepped through the levels. Per level: the cold output tok/s over the
    whole level ("cold_tok_s") and over its second half ("cold_settled_tok_s": after the
    pool has had half a level to move memory back), and the hot output tok/s meanwhile."""
    rates: dict[str, dict[int, float]] = {"cold_tok_s": {}, "cold_settled_tok_s": {},
                                          "hot_tok_s_by_level": {}}
    for level in args.levels:
        timeline.append({"t": time.monotonic() - t0, "level": level, "model": model})
        streams = Streams(client, model, prompts, level, args.cold_tokens)
        start = time.monotonic()
        time.sleep(args.phase_s)
        end = time.monotonic()
        rates["cold_tok_s"][level] = streams.tok_s(start, end)
        rates["cold_settled_tok_s"][level] = streams.tok_s((start + end) / 2, end)
        rates["hot_tok_s_by_level"][level] = hot.tok_s(start, end)
        streams.stop()
        for index, texts in streams.outputs.items():
            outputs.setdefault(index, set()).update(texts)
    return rates


def phase(client: Client, hot_model: str, cold_model: str, hot_prompts: list[str],
          cold_prompts: list[str], args: argparse.Namespace, result: dict, t0: float,
          fill_pool: bool) -> dict:
    hot = Streams(client, hot_model, hot_prompts, args.hot_streams, args.hot_tokens)
    start = time.monotonic()
    share = None
    if fill_pool:  # the hot model fills the idle cold model's pool first
        deadline = time.monotonic() + 300
        while True:
            stats = client.pool_stats()
            if stats["size"] and stats["hot_pages"] >= 0.8 * stats["size"]:
                share = stats["hot_pages"] / stats["size"]
                break
            if time.monotonic() > deadline:
                raise RuntimeError("the hot model did not fill the pool: more --hot-streams")
            time.sleep(0.5)
        print(f"hot tenant holds {share:.0%} of the idle cold pool", flush=True)
    else:
        time.sleep(10)  # the same warm-up as the weaving phase's fill, roughly
    cold_outputs: dict[int, set[str]] = {}
    rates = cold_levels(client, cold_model, cold_prompts, args, cold_outputs,
                        result["timeline"], t0, hot)
    hot_tok_s = hot.tok_s(start, time.monotonic())
    stats = client.pool_stats()
    sent = hot.stop()
    for level, rate in rates["cold_tok_s"].items():
        print(f"  {cold_model}, {level} streams, hot load on {hot_model}: {rate:.1f} tok/s "
              f"({rates['cold_settled_tok_s'][level]:.1f} in the second half; hot "
              f"{rates['hot_tok_s_by_level'][level]:.1f} tok/s)", flush=True)
    return {**rates, "hot_tok_s": hot_tok_s, "hot_requests": sent,
            "hot_outputs": hot.outputs, "cold_outputs": cold_outputs,
            "hot_share_of_idle_pool": share,
            "hot_share_after": stats["hot_pages"] / stats["size"] if stats["size"] else None,
            "reclaims": stats["reclaims"], "reclaim_preemptions": stats["preemptions"]}


def run(args: argparse.Namespace) -> dict:
    smollm2, tiny = prepare_model("smollm2-135m-instruct"), prepare_model("tiny-llama-c")
    root = Path(tempfile.mkdtemp(prefix="weaver-pool-reclaim-"))
    config = root / "deployment.yaml"
    config.write_text(DEPLOYMENT.format(
        smollm2=SMOLLM2_ENGINE.format(path=smollm2), tiny=TINY_ENGINE.format(path=tiny),
        total_gib=args.own_gib + args.lend_gib, own_gib=args.own_gib, lend_gib=args.lend_gib))
    hot_prompts = make_prompts(32)
    cold_prompts = make_prompts(32, offset=3)
    result: dict = {"args": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()},
                    "machine": {"platform": platform.platform()}, "timeline": []}
    with weaver_server(config, root / "serve.log") as server:
        client = Client(server.base_url)
        print("reference outputs (ref, cold-ref) ...", flush=True)
        hot_reference = client.complete_all("ref", hot_prompts, args.hot_tokens)
        cold_reference = client.complete_all("cold-ref", cold_prompts, args.cold_tokens)
        t0 = time.monotonic()
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(1.0):
                result["timeline"].append({"t": time.monotonic() - t0, **client.pool_stats()})

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        print("dedicated deployment: hot load on ref, cold load on cold-ref", flush=True)
        dedicated = phase(client, "ref", "cold-ref", hot_prompts, cold_prompts, args, result,
                          t0, fill_pool=False)
        print("weaving through the unified pool: hot load on hot, cold load on cold",
              flush=True)
        weaving = phase(client, "hot", "cold", hot_prompts, cold_prompts, args, result, t0,
                        fill_pool=True)
        stop.set()
        watcher.join()

    def mismatched(outputs: dict[int, set[str]], reference: list[str]) -> list[int]:
        return sorted(i for i, texts in outputs.items() if texts != {reference[i]})

    hot_bad = mismatched(dedicated["hot_outputs"], hot_reference) + mismatched(
        weaving["hot_outputs"], hot_reference)
    cold_bad = mismatched(dedicated["cold_outputs"], cold_reference) + mismatched(
        weaving["cold_outputs"], cold_reference)
    for part in (dedicated, weaving):
        del part["hot_outputs"], part["cold_outputs"]
    result.update({
        "dedicated": dedicated, "weaving": weaving,
        "cold_ratio_at_levels": {level: weaving["cold_tok_s"][level]
                                 / dedicated["cold_tok_s"][level] for level in args.levels},
        "cold_settled_ratio_at_levels": {
            level: weaving["cold_settled_tok_s"][level] / dedicated["cold_settled_tok_s"][level]
            for level in args.levels},
        "hot_token_exact": not hot_bad, "hot_mismatched_prompts": hot_bad,
        "cold_token_exact": not cold_bad, "cold_mismatched_prompts": cold_bad,
    })
    return result


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = [p for p in result["timeline"] if "size" in p and p["size"]]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot([p["t"] for p in points], [p["hot_pages"] / p["size"] for p in points],
            label="hot tenant's share of the pool")
    for mark in (p for p in result["timeline"] if "level" in p):
        ax.axvline(mark["t"], color="grey", linestyle=":")
        ax.text(mark["t"], 1.02, f"{mark.get('model', 'cold')} x{mark['level']}", fontsize=7)
    ax.set_xlabel("seconds since the hot load started")
    ax.set_ylim(0, 1.1)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    dedicated, weaving = result["dedicated"], result["weaving"]
    print("cold output tok/s per level: whole level | second half (after the reclaim); "
          "hot tok/s meanwhile")
    print(f"{'cold streams':>12} {'dedicated':>17} {'weaving':>17} {'ratio':>11} "
          f"{'hot D / W':>13}")
    for level in args.levels:
        d, w = dedicated, weaving
        print(f"{level:>12} {d['cold_tok_s'][level]:>8.1f} | "
              f"{d['cold_settled_tok_s'][level]:>6.1f} "
              f"{w['cold_tok_s'][level]:>8.1f} | {w['cold_settled_tok_s'][level]:>6.1f} "
              f"{result['cold_ratio_at_levels'][level]:>4.2f} | "
              f"{result['cold_settled_ratio_at_levels'][level]:>4.2f} "
              f"{d['hot_tok_s_by_level'][level]:>6.1f} / {w['hot_tok_s_by_level'][level]:>4.1f}")
    last = args.levels[-1]
    print(f"cold tok/s with weaving / dedicated at {last} streams: "
          f"{result['cold_ratio_at_levels'][last]:.2f} over the level, "
          f"{result['cold_settled_ratio_at_levels'][last]:.2f} once recovered (second half; "
          "target >= 0.90)")
    print(f"hot tok/s during the phase: dedicated {dedicated['hot_tok_s']:.1f}, weaving "
          f"{weaving['hot_tok_s']:.1f}; hot requests completed: {dedicated['hot_requests']} "
          f"and {weaving['hot_requests']}")
    print(f"hot tenant's share: {weaving['hot_share_of_idle_pool']:.0%} of the idle pool, "
          f"{weaving['hot_share_after']:.0%} at the end of the cold load; "
          f"{weaving['reclaims']:.0f} reclaims, {weaving['reclaim_preemptions']:.0f} remote "
          "requests preempted")
    print(f"token-exact against dedicated engines: hot {result['hot_token_exact']}, "
          f"cold {result['cold_token_exact']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        plot(result, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if result["hot_token_exact"] and result["cold_token_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
