"""`k3` command line. Each subcommand lives in its own module exposing `add_parser(sub)`,
which registers the parser and sets `func` (args -> exit code)."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

# Modules under k3.cli, one per subcommand; each imports its heavy dependencies inside `run`.
COMMANDS = [
    "info",
    "generate",
    "train",
    "sft",
    "chat_template",
    "serve",
    "chat",
    "eval",
    "rl",
    "distill",
    "quantize",
    "train_draft",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"k3.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    try:
        return int(args.func(args) or 0)
    except Exception as e:  # noqa: BLE001 - user errors become one line; anything else keeps its traceback
        if not _user_error(e) or os.environ.get("K3_DEBUG"):
            raise
        print(f"k3 {args.command}: error: {e}", file=sys.stderr)
        return 2


def _user_error(e: Exception) -> bool:
    """Missing files, bad configs and checkpoints that do not match: the user's to fix (set K3_DEBUG=1 for
    the traceback)."""
    from k3.config import ConfigError
    from k3.model.safetensors_io import CheckpointError

    return isinstance(e, (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError, ConfigError,
                          CheckpointError))


if __name__ == "__main__":
    sys.exit(main())
