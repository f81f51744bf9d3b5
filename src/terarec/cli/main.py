"""``terarec`` command line: one module per subcommand, each registering itself here.

``SUBCOMMANDS`` names each module in ``terarec.cli`` with its one-line summary. A run
imports only the module of the subcommand it names; ``terarec --help`` (and a missing
or unknown subcommand) imports none, listing the summaries from ``SUBCOMMANDS``.

The contract of a subcommand module ``terarec.cli.NAME``:

- it defines ``add_parser(subparsers) -> None``, which adds the parser ``NAME`` (with
  ``help=SUBCOMMANDS[NAME]``) and sets ``func=run``; ``run(args) -> int`` returns the
  exit code;
- importing it and calling ``add_parser`` need only light modules (the standard
  library, ``terarec.config`` and other modules that import no torch, numpy-backed
  stacks, numba, duckdb, pyarrow, optuna, fastapi or matplotlib), so that
  ``terarec NAME --help`` and every flag error answer at once; ``run`` imports the
  heavy modules it needs inside the function. ``tests/cli/test_cli_startup.py`` checks
  the modules imported.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import sys
from typing import NoReturn

SUBCOMMANDS: dict[str, str] = {
    "quickstart": "synthesise data, train, evaluate, report",
    "synth": "write synthetic Criteo-format click logs",
    "train": "train a model",
    "eval": "evaluate a model on labelled data",
    "predict": "score rows with a model",
    "search": "hyper-parameter search, trials trained together",
    "export": "export a trained model for serving",
    "index": "build an item-vector index for /retrieve",
    "publish": "publish an exported version to a Redis Cluster",
    "cluster": "start, check or stop a local Redis Cluster",
    "serve": "serve an exported model over HTTP",
    "autofeature": "generate and select SQL aggregate features",
    "inspect": "summarise a model directory's store",
}


# Subcommands that run as torchrun ranks (one code path for 1..N); the others run whole
# in one process.
RANK_COMMANDS = frozenset({"train", "search"})


class UserError(Exception):
    """An error in the user's input: printed as one line, exit code 2, no traceback."""


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """The command line with ``only`` (a subcommand's name) in full; the others, or all
    when ``only`` names none, as their one-line summaries. Importing every subcommand's
    modules (torch, serving, search, ...) cost each run, each torchrun rank and each
    ``--help`` seconds."""
    parser = argparse.ArgumentParser(
        prog="terarec", description="Train and serve CTR models whose sparse embedding "
        "tables outgrow one machine.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, summary in SUBCOMMANDS.items():
        if name == only:
            importlib.import_module(f"terarec.cli.{name}").add_parser(sub)
        else:
            sub.add_parser(name, help=summary, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv[0] if argv and not argv[0].startswith("-") else None
    args = build_parser(command).parse_args(argv)
    if not hasattr(args, "func"):  # only a subcommand given in full sets it
        args = build_parser(args.command).parse_args(argv)
    from terarec.io import NOT_WRITABLE, LockedError, NotWritableError

    try:
        _check_launch(args.command)
        return int(args.func(args) or 0)
    except (UserError, ValueError, FileNotFoundError, LockedError) as exc:
        print(f"terarec {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        if not _stdout_closed():
            raise  # a socket or another pipe: a real failure
        return 1  # ``terarec inspect M | head``: the reader has what it wanted
    except OSError as exc:  # a path the user named cannot be written: one line
        if exc.errno not in NOT_WRITABLE and not isinstance(exc, NotWritableError):
            raise
        shown = exc.strerror if isinstance(exc, NotWritableError) else exc
        print(f"terarec {args.command}: error: {shown}", file=sys.stderr)
        return 2


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (its write end polls as an
    error), so that a BrokenPipeError came from printing, not from a connection."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll()
        return False


def _check_launch(command: str) -> None:
    """Refuse a one-process subcommand started as several torchrun ranks: each rank ran
    it whole, so ``export`` wrote one version per rank, ``predict`` printed every score
    once per rank and ``eval`` / ``inspect`` repeated their report."""
    world = os.environ.get("WORLD_SIZE", "1")
    if command in RANK_COMMANDS or not world.isdigit() or int(world) <= 1:
        return
    from terarec.distributed.context import launched_by_torchrun

    if launched_by_torchrun():
        raise UserError(f"{command} runs in one process, not as {world} torchrun ranks "
                        f"(each would run it whole); run it without torchrun")


def run() -> NoReturn:
    """The ``terarec`` program: ``main``, then exit without tearing the interpreter down.

    Finalising the thousands of modules torch loads (its compiler stack comes with the
    optimizers) took 1.5-3 s after every command, on every torchrun rank. The exit
    handlers still run (temporary folders, locks, logging) and output is flushed; only
    the module-by-module teardown is skipped."""
    code = main()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        # closed, or a broken pipe: nothing left to save
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
