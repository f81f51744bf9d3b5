"""``terarec`` command line: one module per subcommand, each registering itself here.

Each module in ``terarec.cli`` listed in ``SUBCOMMANDS`` defines
``add_parser(subparsers) -> None``, which adds its parser and sets ``func=run`` where
``run(args) -> int`` returns the exit code.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = [
    "quickstart", "synth", "train", "eval", "predict",
    "search", "export", "publish", "serve",
    "autofeature",
    "inspect",
]


class UserError(Exception):
    """An error in the user's input: printed as one line, exit code 2, no traceback."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="terarec", description="Train and serve CTR models whose sparse embedding "
        "tables outgrow one machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        importlib.import_module(f"terarec.cli.{name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError) as exc:
        print(f"terarec {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
