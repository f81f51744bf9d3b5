"""Distributed scaling on one machine: 1 rank x 1 thread against 2 ranks x 1 thread.

Same synthetic Criteo-format data, same global batch and passes. Two measurements:

* training loop (``sps_1rank``, ``sps_2ranks``, ``scaling``): each process first reads
  its share of every pass into memory, then the clock runs over the passes as ``fit``
  trains them: planning in the read-ahead thread, staging, steps, all-to-alls, DDP,
  write-back, from the second pass on (the first warms up). Reading is left out on
  purpose: a single process already parses on a second core in its read-ahead thread,
  so on a 2-core machine an end-to-end figure measures the parser as much as the
  training.
* end to end (``sps_cli_1rank``, ``sps_cli_2ranks``, ``scaling_cli``): rows / wall time
  of the whole ``terarec train`` command (start-up, reading, training, validation), as
  a user sees it; each rank reads only its share of the input. ``phases_cli_1rank`` /
  ``phases_cli_2ranks``: where the best run of each side spent its wall time (the
  run's ``phase_seconds`` from ``metrics.json``, rank 0's, plus ``wall`` and
  ``other``: the launcher, the report, exiting; ``rows_trained`` and ``passes``: the
  run stops on validation patience, so both sides must show the same);
  ``load_avg_start`` / ``load_avg``: the machine's load around the measurement (other
  work skews every ratio).

* over an emulated link (``sps_2ranks_emulated_10gbps``, ``scaling_emulated_10gbps``,
  ``emulated_10gbps_kept``: its share of the loopback ``scaling``): the headline 2-rank
  loop again, with every row exchange and dense all-reduce first waiting bytes /
  ``--emulate-gbps`` + ``--emulate-latency-us`` (``terarec.distributed.link``, no
  netem); ``link_bytes_per_step`` / ``link_calls_per_step``: what rank 0 paid it.
  ``projected_scaling``: from those figures and the measured 1- and 2-rank speeds, the
  scaling at 8 and 64 ranks on 10 and 100 Gb/s links (``projected_scaling``'s
  docstring and docs/distributed.md give the model).

The scaling pair runs ``--repeats`` times, interleaved; ``scaling`` compares the best
runs (other processes on a shared machine only ever slow a run down), ``scaling_median``
the medians, and every run's figure is listed. The pair runs at the headline global batch
(``--batch-size``, 8192: 4096 rows per rank) and at each of ``--also-batch-sizes``
(``scaling_by_batch``): every step pays a fixed price in exchanges (on gloo over loopback
about 0.3-0.5 ms per all-to-all and 1.6 ms per all-reduce, whatever the size), so the
smaller the batch per rank, the larger its share. The fp16, dgc and end-to-end runs
once, at the headline batch.

Usage: ``python benchmarks/distributed_scaling.py [--rows 1000000] [--batch-size 8192]
[--also-batch-sizes 4096] [--repeats 3] [--cli-repeats 1] [--cli-only]
[--loop-only] [--dense-comm-only] [--workdir DIR]``.
The default run takes about 8 minutes on 2 idle cores; ``--cli-only`` measures only the
end-to-end pair (``--cli-repeats`` runs per side, interleaved, the best counts);
``--dense-comm-only`` only the 2-rank runs of each dense exchange (bytes and AUC);
``--loop-only`` everything but the end-to-end pair.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from terarec.config import DenseCommConfig
from terarec.loopback import free_port

REPO = Path(__file__).resolve().parents[1]


def _launch(args: argparse.Namespace, ranks: int, target: list[str],
            extra_env: dict[str, str] | None = None) -> float:
    cmd = [sys.executable]
    if ranks > 1:
        cmd += ["-m", "torch.distributed.run", "--nproc_per_node", str(ranks),
                "--master_port", str(free_port())]
    cmd += target
    path = os.pathsep.join(p for p in (str(REPO / "src"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, **(extra_env or {})}
    start = time.perf_counter()
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-4000:]}")
    return time.perf_counter() - start


def train_loop(args: argparse.Namespace, ranks: int, dense_comm: str,
               link_gbps: float = 0.0) -> dict:
    """One training-loop measurement; ``link_gbps`` > 0: over an emulated link of that
    bandwidth and ``--emulate-latency-us`` (``terarec.distributed.link``)."""
    from terarec.distributed.link import GBPS_ENV, LATENCY_ENV

    name = f"loop-{ranks}-{dense_comm}" + (f"-{link_gbps:g}gbps" if link_gbps else "")
    out = args.workdir / f"{name}.json"
    env = {GBPS_ENV: str(link_gbps), LATENCY_ENV: str(args.emulate_latency_us)}
    _launch(args, ranks, [str(Path(__file__).resolve()), "--worker", "--workdir",
                          str(args.workdir), "--out", str(out), "--dense-comm", dense_comm,
                          *_shared_flags(args)], env if link_gbps else None)
    return json.loads(out.read_text())


def train_cli(args: argparse.Namespace, ranks: int) -> tuple[float, dict]:
    """Rows per second of wall time for the whole ``terarec train`` command, and where
    its wall time went: the run's ``phase_seconds`` (rank 0's), ``wall`` and ``other``
    (the rest: the launcher, the report, exiting)."""
    out = Path(tempfile.mkdtemp(prefix=f"cli-{ranks}-", dir=args.workdir))  # a fresh run
    seconds = _launch(args, ranks, [
        "-m", "terarec", "train", "--train", str(args.workdir / "train.txt"),
        "--valid", str(args.workdir / "valid.txt"), "--out", str(out),
        "--batch-size", str(args.batch_size), "--pass-rows", str(args.pass_rows),
        "--model", args.model, "--threads", "1", "--no-progress", "--seed", "0",
        "--no-refit"])  # the training run itself, not a second one on train + valid
    metrics = json.loads((out / "metrics.json").read_text())
    phases = metrics.get("phase_seconds", {})
    phases = {**phases, "wall": seconds, "other": seconds - sum(phases.values())}
    # Validation-driven epochs: both sides must train the same passes to compare.
    return args.rows / seconds, {**{k: round(v, 2) for k, v in phases.items()},
                                 "rows_trained": metrics["rows"], "passes": metrics["passes"]}


def cli_pair(args: argparse.Namespace) -> dict:
    """The whole ``terarec train`` command on 1 and on 2 ranks, ``--cli-repeats`` times
    interleaved; the best run of each side counts."""
    ones, twos = [], []
    for _ in range(args.cli_repeats):
        ones.append(train_cli(args, 1))
        twos.append(train_cli(args, 2))
    one, two = max(ones, key=lambda r: r[0]), max(twos, key=lambda r: r[0])
    return {"sps_cli_1rank": round(one[0], 1), "sps_cli_2ranks": round(two[0], 1),
            "scaling_cli": round(two[0] / one[0], 3),
            "sps_cli_1rank_runs": [round(r[0]) for r in ones],
            "sps_cli_2ranks_runs": [round(r[0]) for r in twos],
            "phases_cli_1rank": one[1], "phases_cli_2ranks": two[1]}


def _shared_flags(args: argparse.Namespace) -> list[str]:
    return ["--batch-size", str(args.batch_size), "--pass-rows", str(args.pass_rows),
            "--model", args.model, "--dgc-ratio", str(args.dgc_ratio),
            "--dgc-momentum", str(args.dgc_momentum),
            "--dgc-warmup-steps", str(args.dgc_warmup_steps), "--autocast", args.autocast]


def worker(args: argparse.Namespace) -> None:
    """One process of a training-loop measurement (plain, or one torchrun rank)."""
    import torch

    from terarec.config import DenseCommConfig, ModelConfig, TrainConfig
    from terarec.distributed import link
    from terarec.distributed.context import init_distributed, launched_by_torchrun
    from terarec.distributed.sharding import iter_rank_passes
    from terarec.train.passes import group_passes, iter_file_batches, prefetch
    from terarec.train.trainer import Trainer
    from terarec.types import FeatureSchema

    schema = FeatureSchema.criteo()
    config = TrainConfig(batch_size=args.batch_size, pass_rows=args.pass_rows, threads=1,
                         seed=0, model=ModelConfig(name=args.model),
                         autocast=args.autocast)
    train_file = args.workdir / "train.txt"
    valid = list(iter_file_batches([args.workdir / "valid.txt"], schema, args.batch_size))
    if launched_by_torchrun():
        ctx = init_distributed("cpu")
        comm = DenseCommConfig(mode=args.dense_comm, dgc_ratio=args.dgc_ratio,
                               dgc_momentum=args.dgc_momentum,
                               dgc_warmup_steps=args.dgc_warmup_steps)
        trainer = Trainer(schema, config, ctx=ctx, dense_comm=comm)
        passes = list(iter_rank_passes([train_file], schema, args.batch_size, args.pass_rows,
                                       ctx.rank, ctx.world))
        ctx.barrier()
    else:
        ctx = None
        torch.set_num_threads(1)
        trainer = Trainer(schema, config)
        passes = list(group_passes(iter_file_batches([train_file], schema, args.batch_size),
                                   args.pass_rows))
    # Pass planning runs in the read-ahead thread, as in ``fit`` (on N ranks: requests
    # and their key exchange, in the planning group).
    history, start, paid = [], 0.0, (0.0, 0)
    for number, planned in enumerate(prefetch(trainer.plan(p, ahead=True) for p in passes)):
        history.append(trainer.train_pass(planned).as_dict())
        if number == 0:  # the first pass warms up (DDP buckets, compiled kernels)
            start = time.perf_counter()
            paid = (link.TALLY.bytes, link.TALLY.calls)
    seconds = time.perf_counter() - start
    steps = max(sum(len(p) for p in passes[1:]), 1)
    history = history[1:]
    auc = trainer.evaluate(valid)["auc"]
    rows = sum(h["rows"] for h in history)
    if ctx is None or ctx.is_main:
        result = {"samples_per_s": rows / seconds, "auc": auc, "rows": rows,
                  "dense_bytes_per_step": history[-1].get("dense_bytes_per_step", 0.0),
                  "sparse_bytes_per_step": history[-1].get("sparse_bytes_per_step", 0.0),
                  # on an emulated link: what rank 0 paid it per step (timed passes)
                  "link_bytes_per_step": (link.TALLY.bytes - paid[0]) / steps,
                  "link_calls_per_step": (link.TALLY.calls - paid[1]) / steps}
        args.out.write_text(json.dumps(result))
    if ctx is not None:
        ctx.close()


def projected_scaling(sps_1rank: float, sps_2ranks: float, batch_size: int,
                      link_bytes: float, link_calls: float, ranks: int, gbps: float,
                      latency_us: float) -> float:
    """Scaling at ``ranks`` ranks on a ``gbps`` link, from the 2-rank measurement (weak
    scaling: each rank keeps the 2-rank run's batch_size / 2 rows a step).

    A step takes the 2-rank loopback step (compute and loopback exchanges, kept as
    they are: an overestimate) plus the wire: what a rank sends grows from its 2-rank
    share to 2 (N - 1) / N of it (all-to-all: (N - 1) / N of its rows go elsewhere
    instead of 1 / 2; ring all-reduce: 2 (N - 1) / N of the gradients instead of 1),
    and each collective pays the latency N - 1 times (ring / pairwise rounds)."""
    step_2 = batch_size / sps_2ranks
    wire = (link_bytes * 2 * (ranks - 1) / ranks * 8 / (gbps * 1e9)
            + link_calls * (ranks - 1) * latency_us * 1e-6)
    rows_per_s = ranks * (batch_size / 2) / (step_2 + wire)
    return rows_per_s / sps_1rank


def scaling_pair(args: argparse.Namespace, emulate: bool = False) -> dict:
    """1 rank against 2 ranks at ``args.batch_size``, ``args.repeats`` times interleaved
    (a noisy spell hits both sides); runs are deterministic, so AUC and bytes do not
    change between repeats. ``emulate``: 2 ranks over the emulated ``--emulate-gbps``
    link too, in the same interleaving, and the projection to 8 and 64 ranks."""
    ones, twos, slow = [], [], []
    for _ in range(args.repeats):
        ones.append(train_loop(args, 1, "none"))
        twos.append(train_loop(args, 2, "none"))
        if emulate:
            slow.append(train_loop(args, 2, "none", args.emulate_gbps))
    one = max(ones, key=lambda r: r["samples_per_s"])
    two = max(twos, key=lambda r: r["samples_per_s"])
    emulated: dict = {}
    if slow:
        best = max(slow, key=lambda r: r["samples_per_s"])
        tag = f"{args.emulate_gbps:g}gbps"
        scaling = two["samples_per_s"] / one["samples_per_s"]
        emulated = {
            f"sps_2ranks_emulated_{tag}": round(best["samples_per_s"], 1),
            f"scaling_emulated_{tag}": round(best["samples_per_s"] / one["samples_per_s"], 3),
            f"emulated_{tag}_kept": round(best["samples_per_s"] / one["samples_per_s"]
                                          / scaling, 3),
            "emulated_latency_us": args.emulate_latency_us,
            "link_bytes_per_step": round(best["link_bytes_per_step"], 1),
            "link_calls_per_step": round(best["link_calls_per_step"], 2),
            "projected_scaling": {
                str(n): {f"{g:g}gbps": round(projected_scaling(
                    one["samples_per_s"], two["samples_per_s"], args.batch_size,
                    best["link_bytes_per_step"], best["link_calls_per_step"], n, g,
                    args.emulate_latency_us), 2) for g in (10.0, 100.0)}
                for n in (8, 64)}}
    return {
        "one": one, "two": two,
        "sps_1rank": round(one["samples_per_s"], 1),
        "sps_2ranks": round(two["samples_per_s"], 1),
        "scaling": round(two["samples_per_s"] / one["samples_per_s"], 3),
        "scaling_median": round(statistics.median(r["samples_per_s"] for r in twos)
                                / statistics.median(r["samples_per_s"] for r in ones), 3),
        "sps_2ranks_runs": [round(r["samples_per_s"]) for r in twos],
        "sps_1rank_runs": [round(r["samples_per_s"]) for r in ones],
        **emulated,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--valid-rows", type=int, default=30_000)
    p.add_argument("--batch-size", type=int, default=8192,
                   help="global batch of the headline figures, dense-comm and CLI runs")
    p.add_argument("--also-batch-sizes", default="4096",
                   help="comma-separated global batches whose scaling pair is also measured")
    p.add_argument("--pass-rows", type=int, default=200_000)
    p.add_argument("--model", default="deepfm")
    dgc = DenseCommConfig()  # the library's DGC defaults, as `train --dense-comm dgc` runs
    p.add_argument("--dgc-ratio", type=float, default=dgc.dgc_ratio)
    p.add_argument("--dgc-momentum", type=float, default=dgc.dgc_momentum)
    p.add_argument("--dgc-warmup-steps", type=int, default=dgc.dgc_warmup_steps)
    p.add_argument("--autocast", choices=("auto", "bf16", "off"), default="auto",
                   help="the training loops' dense-step switch (train.dense_step)")
    p.add_argument("--repeats", type=int, default=3,
                   help="training-loop runs per side of each scaling pair; the best counts")
    p.add_argument("--cli-repeats", type=int, default=1,
                   help="end-to-end runs per side, interleaved; the best counts")
    p.add_argument("--cli-only", action="store_true",
                   help="measure only the end-to-end pair (the _cli figures)")
    p.add_argument("--emulate-gbps", type=float, default=10.0,
                   help="also run the headline 2-rank loop over an emulated link of this "
                        "many Gb/s (0: not) and project scaling to 8 and 64 ranks")
    p.add_argument("--emulate-latency-us", type=float, default=50.0,
                   help="the emulated link's latency per collective, microseconds")
    p.add_argument("--loop-only", action="store_true",
                   help="leave out the end-to-end pair (the _cli figures)")
    p.add_argument("--dense-comm-only", action="store_true",
                   help="measure only the 2-rank dense exchanges (none, fp16, dgc): "
                        "bytes and validation AUC")
    p.add_argument("--workdir", type=Path, default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dense-comm", default="none", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.emulate_gbps < 0:
        p.error(f"--emulate-gbps must be >= 0 (0: no emulated link), got {args.emulate_gbps}")
    if args.emulate_latency_us < 0:
        p.error(f"--emulate-latency-us must be >= 0, got {args.emulate_latency_us}")
    if args.worker:
        worker(args)
        return
    from terarec.data.synth import generate

    load_start = round(os.getloadavg()[0], 2)  # other work on a shared machine skews ratios
    with tempfile.TemporaryDirectory(prefix="terarec-dist-bench-") as tmp:
        args.workdir = args.workdir or Path(tmp)
        args.workdir.mkdir(parents=True, exist_ok=True)
        if not (args.workdir / "train.txt").exists():
            generate(args.workdir / "train.txt", args.rows, sample_seed=1)
            generate(args.workdir / "valid.txt", args.valid_rows, sample_seed=2)
        if args.dense_comm_only:
            two = {c: train_loop(args, 2, c) for c in ("none", "fp16", "dgc")}
            print(json.dumps({"rows": args.rows, "batch_size": args.batch_size,
                              "model": args.model, **dense_comm_figures(args, two),
                              "load_avg_start": load_start,
                              "load_avg": round(os.getloadavg()[0], 2)}))
            return
        cli = {} if args.loop_only else cli_pair(args)
        if args.cli_only:
            print(json.dumps({"rows": args.rows, "batch_size": args.batch_size,
                              "model": args.model, **cli,
                              "load_avg_start": load_start,
                              "load_avg": round(os.getloadavg()[0], 2)}))
            return
        others = sorted({int(b) for b in args.also_batch_sizes.split(",") if b.strip()}
                        - {args.batch_size})
        by_batch = {}
        for batch in others:
            by_batch[batch] = scaling_pair(argparse.Namespace(**{**vars(args),
                                                                 "batch_size": batch}))
        main_pair = by_batch[args.batch_size] = scaling_pair(args,
                                                             emulate=args.emulate_gbps > 0)
        two = {"none": main_pair["two"]}
        two.update({c: train_loop(args, 2, c) for c in ("fp16", "dgc")})
    headline = {k: v for k, v in main_pair.items() if k not in ("one", "two")}
    print(json.dumps({
        "rows": args.rows, "batch_size": args.batch_size, "model": args.model,
        "repeats": args.repeats, **headline,
        "scaling_by_batch": {str(b): {k: r[k] for k in ("sps_1rank", "sps_2ranks", "scaling",
                                                        "scaling_median")}
                             for b, r in sorted(by_batch.items())},
        "sps_2ranks_dgc": round(two["dgc"]["samples_per_s"], 1),
        **cli,
        "auc_1rank": round(main_pair["one"]["auc"], 5),
        **dense_comm_figures(args, two),
        "load_avg_start": load_start, "load_avg": round(os.getloadavg()[0], 2),
    }))


def dense_comm_figures(args: argparse.Namespace, two: dict[str, dict]) -> dict:
    """Dense bytes per step and validation AUC of the 2-rank runs of each exchange."""
    dense = {c: r["dense_bytes_per_step"] for c, r in two.items()}
    return {
        "bytes_per_step": {c: round(b, 1) for c, b in dense.items()},
        "sparse_bytes_per_step": round(two["none"]["sparse_bytes_per_step"], 1),
        "dgc_ratio": args.dgc_ratio, "dgc_momentum": args.dgc_momentum,
        "dgc_warmup_steps": args.dgc_warmup_steps, "autocast": args.autocast,
        "dgc_compression": round(dense["none"] / dense["dgc"], 1),
        "auc_none": round(two["none"]["auc"], 5),
        "auc_fp16": round(two["fp16"]["auc"], 5),
        "auc_dgc": round(two["dgc"]["auc"], 5),
        "delta_auc_dgc": round(two["dgc"]["auc"] - two["none"]["auc"], 5)}


if __name__ == "__main__":
    main()
