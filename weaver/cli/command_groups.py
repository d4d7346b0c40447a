"""What a command group (`weaver models`, `weaver bench`, `weaver cluster`) does when it is
run without one of its commands: print its help and exit 2, as argparse does for a usage
error."""

from __future__ import annotations

import argparse


def require_command(parser: argparse.ArgumentParser) -> None:
    """Make `parser`, a group of subcommands, print its help and return 2 when run bare."""
    parser.set_defaults(handler=lambda _args: _print_help(parser))


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2
