"""vLLM's own `vllm serve` argument parser, as Weaver uses it for engine flags.

Two directions, both through vLLM's parser (`make_arg_parser`), so that a flag means and
checks exactly what it does under `vllm serve`:
- `flags_for`: a deployment's `extra_engine_args` (Python names, YAML values) as the
  command-line flags vLLM takes, so that `weaver config` rejects a wrong name or value
  before any engine starts and `weaver config --engines` prints the flags;
- `engine_args_from_flags`: the flags after `weaver serve MODEL` as the arguments they set.
Importing this module imports no vLLM; the functions do.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Mapping, Sequence
from typing import Any

# `vllm serve` flags that configure its own HTTP server. Under Weaver one gateway serves
# every model (weaver/server/gateway.py), so they cannot take effect per engine; the
# gateway's own are `weaver serve --host/--port/--api-key`.
FRONT_END_SERVER_ARGS = frozenset({
    "host", "port", "uds", "api_key", "ssl_keyfile", "ssl_certfile", "ssl_ca_certs",
    "ssl_cert_reqs", "ssl_ciphers", "enable_ssl_refresh", "root_path", "middleware",
    "allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials",
    "uvicorn_log_level", "disable_uvicorn_access_log", "api_server_count",
    "headless", "h11_max_incomplete_event_size", "h11_max_header_count",
})


class EngineFlagError(ValueError):
    """A flag vLLM's parser refuses; the message is argparse's, which names the flag."""


class _RaisingParser:
    """Wraps vLLM's parser: an error raises instead of printing usage and exiting."""

    def __init__(self, parser: argparse.ArgumentParser) -> None:
        self.parser = parser
        self.by_dest = {action.dest: action for action in parser._actions}
        self.defaults = {action.dest: action.default for action in parser._actions}

    def parse(self, argv: Sequence[str]) -> argparse.Namespace:
        def fail(message: str) -> None:
            raise EngineFlagError(message)

        original, self.parser.error = self.parser.error, fail
        try:
            return self.parser.parse_args(list(argv))
        finally:
            self.parser.error = original


@functools.cache
def serve_parser() -> _RaisingParser:
    """`vllm serve`'s parser (built once per process: about a second)."""
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    return _RaisingParser(make_arg_parser(FlexibleArgumentParser(prog="vllm serve")))


def parse_serve_args(argv: Sequence[str]) -> argparse.Namespace:
    """vLLM's parse of `vllm serve` arguments; EngineFlagError says what is wrong."""
    return serve_parser().parse(argv)


def flags_for(engine_args: Mapping[str, Any], owner: str = "extra_engine_args") -> list[str]:
    """`{max_num_batched_tokens: 64, enable_prefix_caching: false}` as
    `--max-num-batched-tokens 64 --no-enable-prefix-caching`; EngineFlagError names an
    argument vLLM does not have or one that only `vllm serve`'s HTTP server reads."""
    by_dest = serve_parser().by_dest
    flags: list[str] = []
    for name, value in engine_args.items():
        action = by_dest.get(name)
        if action is None or not action.option_strings:
            raise EngineFlagError(
                f"{owner} has {name!r}, which is not a vLLM engine argument (use the Python "
                "name of a `vllm serve` flag, e.g. enable_prefix_caching for "
                "--enable-prefix-caching; see `vllm serve --help`)")
        if name in FRONT_END_SERVER_ARGS:
            raise EngineFlagError(
                f"{owner} has {name!r}, which configures vLLM's own HTTP server; behind "
                "Weaver's gateway it cannot apply per engine (weaver serve has --host, "
                "--port and --api-key)")
        flags += _flag_and_value(action, value)
    return flags


def _flag_and_value(action: argparse.Action, value: Any) -> list[str]:
    flag = next(s for s in action.option_strings if s.startswith("--"))
    if isinstance(action, argparse.BooleanOptionalAction):
        return [flag if value else "--no-" + flag.removeprefix("--")]
    if action.nargs == 0:  # store_true / store_const: present or absent
        return [flag] if value else []
    if value is None:
        return []
    if isinstance(value, Mapping):
        return [flag, json.dumps(value)]
    if isinstance(value, list | tuple):
        items = [json.dumps(v) if isinstance(v, Mapping) else str(v) for v in value]
        return [flag, *items] if action.nargs in ("+", "*") else [flag, json.dumps(list(value))]
    if isinstance(value, bool):
        return [flag, "true" if value else "false"]
    return [flag, str(value)]


def engine_args_from_flags(flags: Sequence[str]) -> dict[str, Any]:
    """The arguments that `vllm serve` flags set (those whose value is not vLLM's
    default), by Python name, checked by vLLM's parser; EngineFlagError when it refuses
    one. A positional model (`vllm serve MODEL`) is not taken here."""
    parser = serve_parser()
    if "--model" in flags or any(f.startswith("--model=") for f in flags):
        raise EngineFlagError("give the model as the first argument (weaver serve MODEL "
                              "[flags]), not as --model")
    parsed = vars(parser.parse(["--model", "_", *flags]))
    if parsed.get("model_tag") is not None:  # vLLM's parser takes a stray word as MODEL
        raise EngineFlagError(f"unexpected argument {parsed['model_tag']!r}: the model is "
                              "the first argument, every later one is a flag or its value")
    given = {name: value for name, value in parsed.items()
             if name not in ("model", "model_tag") and value != parser.defaults.get(name)}
    server_only = sorted(given.keys() & FRONT_END_SERVER_ARGS)
    if server_only:
        raise EngineFlagError(
            f"{', '.join('--' + n.replace('_', '-') for n in server_only)}: vLLM's own HTTP "
            "server options cannot apply behind Weaver's gateway (weaver serve has --host, "
            "--port and --api-key)")
    return given
