"""A ``terarec train`` rank that pauses after its first committed pass: it touches
``HOLD_DIR/rank-R`` and waits (at most 180 s) for ``HOLD_DIR/release``, so a test can start
other runs on the same ``--out`` while every rank of this one is alive and holds its locks.

Run as ``torchrun ... hold_after_commit.py train <train args>`` (or with plain python).
"""

import os
import sys
import time
from pathlib import Path

from terarec.cli import train
from terarec.cli.main import build_parser

HOLD_DIR = Path(os.environ["HOLD_DIR"])


def on_commit(trainer) -> None:
    if trainer.pass_id != 1:
        return
    (HOLD_DIR / f"rank-{trainer.rank}").touch()
    deadline = time.monotonic() + 180
    while not (HOLD_DIR / "release").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(train.run(build_parser("train").parse_args(sys.argv[1:]), on_commit=on_commit))
