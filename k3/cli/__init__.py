"""`k3` command line. Each subcommand lives in its own module exposing `add_parser(sub)`,
which registers the parser and sets `func` (args -> exit code)."""

from __future__ import annotations

import argparse
import importlib
import sys

# module name under k3.cli -> subcommand; modules are imported lazily only to build the parser.
COMMANDS = [
    "info",
    "generate",
    "train",
    "chat_template",
    "serve",
    "chat",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="k3", description="Kimi K3 in PyTorch")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(f"k3.cli.{name}")
        except ModuleNotFoundError as e:  # a command not built yet on this branch
            if e.name == f"k3.cli.{name}":
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 1
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
