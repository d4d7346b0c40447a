"""`weaver` command line: one sub-command module per job.

Each module in `SUBCOMMAND_MODULES` exposes `register(subparsers)`, which adds its parser
and sets `handler` to a function taking the parsed arguments and returning an exit code.
Heavy imports (vLLM, torch) happen inside handlers so that `--help` stays instant.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import sys

# Order is the order shown in `weaver --help`.
SUBCOMMAND_MODULES = (
    "weaver.cli.serve",
    "weaver.cli.models",
    "weaver.cli.config",
    "weaver.cli.profile",
    "weaver.cli.bench",
    "weaver.cli.simulate",
    "weaver.cli.cluster",
    "weaver.cli.offload_probe",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weaver",
        description=(
            "Weaver serves many LLMs behind one OpenAI-compatible endpoint on vLLM 0.32.0. "
            "Hot models can weave decode attention of some of their sequences into the "
            "idle memory of cold models."
        ),
        epilog="Run `weaver COMMAND --help` for the options of one command.",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        help="verbosity of Weaver's own log (default: %(default)s)",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).register(subparsers)
    return parser


def _with_default_actions(argv: list[str]) -> list[str]:
    """`weaver bench --config D ...` reads as `weaver bench run --config D ...`: a command
    group whose module names a DEFAULT_ACTION gets it when an option follows the group."""
    if len(argv) < 2 or not argv[1].startswith("-") or argv[1] in ("-h", "--help"):
        return argv
    for module_name in SUBCOMMAND_MODULES:
        module = importlib.import_module(module_name)
        if getattr(module, "COMMAND", None) == argv[0] and hasattr(module, "DEFAULT_ACTION"):
            return [argv[0], module.DEFAULT_ACTION, *argv[1:]]
    return argv


def configure_logging(level: str) -> None:
    """Weaver's log lines at `level`, on stderr, for this process and what it imports."""
    # vLLM's app builder imports model_hosting_container_standards, whose logging_config
    # sets the ROOT logger and its handlers to $SAGEMAKER_CONTAINER_LOG_LEVEL (default
    # ERROR) when first imported: every Weaver INFO and WARNING line of the gateway after
    # its first engine started was dropped. Imported here first, its setting comes before
    # ours and ours stands (and its own chatter stays at ERROR, as vLLM leaves it).
    with contextlib.suppress(ImportError):
        importlib.import_module("model_hosting_container_standards.logging_config")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # httpx logs every request at INFO: one line per benchmark request would bury the
    # progress bar and the results; its warnings and errors still show (all with DEBUG).
    if level != "DEBUG":
        logging.getLogger("httpx").setLevel(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(
        _with_default_actions(sys.argv[1:] if argv is None else argv))
    if unknown:
        if not getattr(args, "takes_vllm_flags", False):
            parser.error(f"unrecognized arguments: {' '.join(unknown)}")
        # `weaver serve MODEL --max-model-len 512`: vLLM's flags, checked by its parser.
        args.vllm_flags = unknown
    configure_logging(args.log_level)
    handler = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 2
    return int(handler(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
