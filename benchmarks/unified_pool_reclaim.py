"""Cold load rising from 0 to saturation while the hot model weaves through the unified pool.

Issue 6's scripted run. One `weaver serve` runs four engines:

- `hot`: SmolLM2, every sequence remote: its KV lives in the cold device's unified pool;
- `cold`: tiny-llama-c with `unified_kv`: its own KV and what it lends in one pool of
  --own-gib + --lend-gib; the allocator moves quota by ADBS and reclaims for the cold model;
- `ref` and `cold-ref`: the same models dedicated; `cold-ref` owns the pool's whole size.

Phases (cold engines pinned to core 1, SmolLM2 engines to core 0):

1. reference: greedy outputs of every prompt from `ref` and `cold-ref`; then `cold-ref`
   alone at each cold concurrency level (--levels) for --phase-s seconds: its dedicated
   output tok/s per level;
2. weaving: --hot-requests long requests to `hot` at once; once the hot tenant holds most of
   the idle pool, the cold load steps through the same levels against `cold`.

Prints the cold output tok/s per level with weaving over dedicated (target: >= 0.9 at the
last, saturating level), the hot tenant's share of the pool before and after, reclaims and
remote requests preempted, and checks that every hot and cold request completed with the
dedicated engines' tokens. Writes JSON (and a PNG of the pool share and cold throughput).

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

from weaver.models.registry import prepare_model
from weaver.server.process import weaver_server

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
    parser.add_argument("--hot-requests", type=int, default=48,
                        help="long requests sent to the hot model at once (default: 48)")
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
    if min(args.levels) < 1 or args.phase_s <= 0 or args.hot_requests < 1:
        parser.error("levels must be >= 1, --phase-s > 0 and --hot-requests >= 1")
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


def cold_level(client: Client, model: str, prompts: list[str], streams: int,
               duration_s: float, max_tokens: int, outputs: dict[int, set]) -> float:
    """`streams` clients sending back-to-back requests for `duration_s`: output tokens of
    the requests that finished inside the window, per second of it."""
    start = time.monotonic()
    tokens = [0] * streams

    def stream(index: int) -> None:
        k = 0
        while time.monotonic() - start < duration_s:
            prompt_index = (index * 7 + k) % len(prompts)
            text, num = client.complete(model, prompts[prompt_index], max_tokens)
            outputs.setdefault(prompt_index, set()).add(text)
            if time.monotonic() - start <= duration_s:
                tokens[index] += num
            k += 1

    with cf.ThreadPoolExecutor(streams) as pool:
        list(pool.map(stream, range(streams)))
    return sum(tokens) / duration_s


def run(args: argparse.Namespace) -> dict:
    smollm2, tiny = prepare_model("smollm2-135m-instruct"), prepare_model("tiny-llama-c")
    root = Path(tempfile.mkdtemp(prefix="weaver-pool-reclaim-"))
    config = root / "deployment.yaml"
    config.write_text(DEPLOYMENT.format(
        smollm2=SMOLLM2_ENGINE.format(path=smollm2), tiny=TINY_ENGINE.format(path=tiny),
        total_gib=args.own_gib + args.lend_gib, own_gib=args.own_gib, lend_gib=args.lend_gib))
    hot_prompts = make_prompts(args.hot_requests)
    cold_prompts = make_prompts(32, offset=3)
    result: dict = {"args": {k: str(v) if isinstance(v, Path) else v
                             for k, v in vars(args).items()},
                    "machine": {"platform": platform.platform()}, "timeline": []}
    with weaver_server(config, root / "serve.log") as server:
        client = Client(server.base_url)
        print("reference outputs (ref, cold-ref) ...", flush=True)
        hot_reference = client.complete_all("ref", hot_prompts, args.hot_tokens)
        cold_reference = client.complete_all("cold-ref", cold_prompts, args.cold_tokens)
        dedicated, cold_outputs = {}, {}
        for level in args.levels:
            dedicated[level] = cold_level(client, "cold-ref", cold_prompts, level,
                                          args.phase_s, args.cold_tokens, cold_outputs)
            print(f"  cold-ref alone, {level} streams: {dedicated[level]:.1f} tok/s", flush=True)
        stop = threading.Event()
        t0 = time.monotonic()

        def watch() -> None:
            while not stop.wait(1.0):
                result["timeline"].append({"t": time.monotonic() - t0, **client.pool_stats()})

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        with cf.ThreadPoolExecutor(1) as pool:
            hot = pool.submit(client.complete_all, "hot", hot_prompts, args.hot_tokens)
            deadline = time.monotonic() + 300
            while True:  # the hot model fills the idle cold model's pool
                stats = client.pool_stats()
                if stats["size"] and stats["hot_pages"] >= 0.8 * stats["size"]:
                    break
                if hot.done() or time.monotonic() > deadline:
                    raise RuntimeError("the hot model did not fill the pool; more --hot-requests")
                time.sleep(0.5)
            share_before = stats["hot_pages"] / stats["size"]
            print(f"hot tenant holds {share_before:.0%} of the idle cold pool", flush=True)
            weaving, weaving_outputs = {}, {}
            for level in args.levels:
                result["timeline"].append({"t": time.monotonic() - t0, "level": level})
                weaving[level] = cold_level(client, "cold", cold_prompts, level,
                                            args.phase_s, args.cold_tokens, weaving_outputs)
                print(f"  cold with hot weaving, {level} streams: {weaving[level]:.1f} tok/s "
                      f"({weaving[level] / dedicated[level]:.2f} of dedicated)", flush=True)
            stats = client.pool_stats()
            hot_outputs = hot.result(timeout=3600)
        stop.set()
        watcher.join()
    mismatched_cold = sorted(i for i, texts in {**cold_outputs, **weaving_outputs}.items()
                             if texts != {cold_reference[i]})
    result.update({
        "dedicated_cold_tok_s": dedicated, "weaving_cold_tok_s": weaving,
        "ratio_at_levels": {level: weaving[level] / dedicated[level] for level in args.levels},
        "hot_share_of_idle_pool": share_before,
        "hot_share_after": stats["hot_pages"] / stats["size"] if stats["size"] else None,
        "reclaims": stats["reclaims"], "reclaim_preemptions": stats["preemptions"],
        "hot_requests_completed": len(hot_outputs),
        "hot_token_exact": hot_outputs == hot_reference,
        "cold_token_exact": not mismatched_cold, "cold_mismatched_prompts": mismatched_cold,
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
        ax.text(mark["t"], 1.02, f"cold x{mark['level']}", fontsize=8)
    ax.set_xlabel("seconds since the hot load started")
    ax.set_ylim(0, 1.1)
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    last = args.levels[-1]
    print(f"cold tok/s with weaving / dedicated at {last} streams: "
          f"{result['ratio_at_levels'][last]:.2f} (target >= 0.90)")
    print(f"hot tenant's share: {result['hot_share_of_idle_pool']:.0%} of the idle pool, "
          f"{result['hot_share_after']:.0%} after the cold load; {result['reclaims']:.0f} "
          f"reclaims, {result['reclaim_preemptions']:.0f} remote requests preempted")
    print(f"hot requests completed {result['hot_requests_completed']}/{args.hot_requests}, "
          f"token-exact: hot {result['hot_token_exact']}, cold {result['cold_token_exact']}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
        plot(result, args.out.with_suffix(".png"))
        print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0 if result["hot_token_exact"] and result["cold_token_exact"] else 1


if __name__ == "__main__":
    sys.exit(main())
