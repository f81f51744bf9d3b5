"""A ``terarec train`` rank that dies once: rank ``KILL_RANK`` exits right after the
checkpoint of pass ``KILL_AFTER_PASS`` is committed, on torchrun's first attempt only.

Run as ``torchrun --max-restarts 1 ... kill_and_resume.py train <train args>``; the
restarted worker group must resume from the last committed pass on its own.
"""

import os
import sys

from terarec.cli import train
from terarec.cli.main import build_parser
from terarec.distributed.context import restart_count

KILL_RANK = int(os.environ["KILL_RANK"])
KILL_AFTER_PASS = int(os.environ["KILL_AFTER_PASS"])


def on_commit(trainer) -> None:
    if restart_count() == 0 and trainer.rank == KILL_RANK and trainer.pass_id == KILL_AFTER_PASS:
        os._exit(17)


if __name__ == "__main__":
    sys.exit(train.run(build_parser("train").parse_args(sys.argv[1:]), on_commit=on_commit))
