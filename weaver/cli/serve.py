"""`weaver serve [CONFIG.yaml]` and `weaver serve MODEL [vLLM flags]`."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

# `vllm serve` flags that are fields of a deployment's model (weaver/config/deployment.py):
# their values go there, so that the gateway's limits and `weaver config` see them too.
SPEC_FIELD_OF_FLAG = {"max_model_len": "max_model_len", "max_num_seqs": "max_num_seqs",
                      "dtype": "dtype", "block_size": "block_size",
                      "num_gpu_blocks_override": "num_gpu_blocks_override"}
GiB = 1 << 30


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="serve every model of a deployment (or one model) on one OpenAI-compatible "
        "endpoint",
        usage="weaver serve [CONFIG.yaml | MODEL [vLLM flags...]] [--host H] [--port P] "
        "[--api-key KEY] [--models-dir DIR]",
        description=(
            "Start one vLLM engine per model of the deployment and serve them all on one "
            "OpenAI-compatible endpoint: GET /v1/models lists them; the OpenAI routes vLLM "
            "serves (completions, chat, responses, embeddings, tokenize, detokenize; "
            "streaming too) route on the request's `model` field; GET /health reports each "
            "engine and GET /metrics exposes Prometheus series labelled by model. An engine "
            "that dies or hangs is restarted (its model answers 503 with Retry-After "
            "meanwhile); the first Ctrl-C or SIGTERM drains (in-flight requests finish, new "
            "ones get 503), a second one stops at once. Limits, deadlines and the restart "
            "policy are in the deployment file (docs/operating.md). "
            "`weaver serve MODEL [vLLM flags]` serves one model as `vllm serve MODEL "
            "[flags]` would: MODEL is a Hugging Face id, a directory or a prepared name, "
            "and every flag after it is vLLM's own, checked by vLLM's parser before "
            "anything starts (e.g. weaver serve Qwen/Qwen2.5-0.5B-Instruct --max-model-len "
            "512)."
        ),
    )
    parser.add_argument(
        "target", nargs="?", default=None, metavar="CONFIG.yaml | MODEL",
        help="a deployment YAML file (default: the embedded two-model deployment; see "
        "`weaver config show`), or one model to serve alone, followed by its vLLM flags",
    )
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: %(default)s, this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (default: %(default)s)")
    parser.add_argument(
        "--api-key", action="append", default=None,
        help="require `Authorization: Bearer KEY` on /v1 routes; repeat for several keys "
        "(default: $WEAVER_API_KEY, or no authentication)",
    )
    parser.add_argument("--models-dir", type=Path, default=None,
                        help="where prepared models live (default: $WEAVER_MODELS_DIR or "
                        "~/.cache/weaver/models)")
    # The flags Weaver does not know are vLLM's (weaver/cli/main.py hands them over).
    parser.set_defaults(handler=run, takes_vllm_flags=True, vllm_flags=[])


def is_deployment_file(target: str | None) -> bool:
    """None (the embedded default), a file, or a name that looks like one (a missing
    YAML file is reported as such, not as an unknown model)."""
    return (target is None or Path(target).is_file()
            or target.lower().endswith((".yaml", ".yml")))


def single_model_deployment(model: str, flags: list[str]):
    """The deployment `weaver serve MODEL FLAGS...` serves: MODEL alone, dedicated, with
    `vllm serve`'s flags (ValueError when vLLM's parser refuses one). The flags that are
    fields of the deployment's model set those fields; all stay the engine's flags."""
    from weaver.config.deployment import parse_deployment
    from weaver.vllm_ext.engine.flags import engine_args_from_flags

    given = engine_args_from_flags(flags)
    spec: dict = {"name": (given.get("served_model_name") or [model])[0], "model": model,
                  "vllm_flags": list(flags)}
    spec.update({field: given[flag] for flag, field in SPEC_FIELD_OF_FLAG.items()
                 if flag in given})
    if "kv_cache_memory_bytes" in given:
        spec["kv_cache_gib"] = given["kv_cache_memory_bytes"] / GiB
    return parse_deployment({"models": [spec]}, f"weaver serve {model}")


def run(args: argparse.Namespace) -> int:
    from weaver.config.deployment import load_deployment
    from weaver.server.app import ServeSettings, check_engines, serve
    from weaver.vllm_ext.engine.app import listening_socket

    if not 0 < args.port < 65536:
        raise SystemExit(f"--port {args.port} is not a TCP port (1-65535)")
    try:
        if is_deployment_file(args.target):
            if args.vllm_flags:
                raise ValueError(
                    f"unrecognized arguments: {' '.join(args.vllm_flags)} (vLLM flags go "
                    "with one model, weaver serve MODEL FLAGS...; in a deployment file they "
                    "are a model's extra_engine_args or vllm_flags)")
            deployment = load_deployment(args.target)
        else:
            deployment = single_model_deployment(args.target, args.vllm_flags)
    except ValueError as exc:
        raise SystemExit(f"weaver serve: {exc}") from None
    env_key = os.environ.get("WEAVER_API_KEY")
    keys = args.api_key or ([env_key] if env_key else [])
    settings = ServeSettings(
        deployment=deployment,
        host=args.host,
        port=args.port,
        api_keys=tuple(keys),
        models_dir=args.models_dir,
        log_level=args.log_level.lower(),
    )
    # A model, a device or a port that cannot be had: say so and start nothing.
    try:
        checked = check_engines(settings)
        listener = listening_socket(settings.host, settings.port)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    return serve(settings, checked, listener)
