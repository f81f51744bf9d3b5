"""How long ``terarec --help`` and ``terarec train --help`` take, beside ``import torch``
measured in the same run: a help or a flag error should answer before torch could even
load.

    python benchmarks/cli_startup.py [--runs 7]

Prints one JSON line: the median wall time of each command over ``--runs`` fresh
interpreters (after one unmeasured run of each, so that all read warm files), and the
machine's load average at the start and the end.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
COMMANDS = {
    "help_s": ["-m", "terarec", "--help"],
    "train_help_s": ["-m", "terarec", "train", "--help"],
    "import_torch_s": ["-c", "import torch"],
}


def wall_time(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    start = time.perf_counter()
    subprocess.run([sys.executable, *argv], env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=7, help="timed runs per command")
    args = parser.parse_args()
    load = [os.getloadavg()[0]]
    for argv in COMMANDS.values():
        wall_time(argv)
    # Interleaved, so that a busy moment of the machine spreads over all three.
    times: dict[str, list[float]] = {name: [] for name in COMMANDS}
    for _ in range(args.runs):
        for name, argv in COMMANDS.items():
            times[name].append(wall_time(argv))
    load.append(os.getloadavg()[0])
    print(json.dumps({"benchmark": "cli_startup", "runs": args.runs,
                      **{name: round(statistics.median(t), 3) for name, t in times.items()},
                      "load_avg": [round(x, 1) for x in load],
                      "python": sys.version.split()[0]}))


if __name__ == "__main__":
    main()
