"""``terarec search`` under torchrun (2 gloo ranks): the same trials, pruning decisions
and values as one process, the best trial a model directory with one shard per rank,
refit on train + valid as one process refits it; a
searched batch size trains as in one process; a rank killed mid-search resumes,
continuing the interrupted trial from its last committed pass."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_torchrun import port_taken

from terarec.data.synth import generate
from terarec.loopback import free_port
from terarec.modeldir import best_checkpoint

pytestmark = pytest.mark.dist
SRC = Path(__file__).resolve().parents[2] / "src"
TIMEOUT_S = 300


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    cmd = list(cmd)
    for _ in range(3):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True,
                              timeout=TIMEOUT_S, start_new_session=True)
        if not port_taken(cmd, done):
            break
    return done


@pytest.fixture(scope="module")
def args(tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("dsearch")
    generate(root / "t.tsv", 3000, model_seed=3, sample_seed=1)
    generate(root / "v.tsv", 1000, model_seed=3, sample_seed=2)
    return ["search", "--train", str(root / "t.tsv"), "--valid", str(root / "v.tsv"),
            "--model", "fm", "--trials", "3", "--sampler", "random", "--pruner", "halving",
            "--prune-after", "1",
            "--epochs", "2", "--batch-size", "250", "--pass-rows", "500", "--threads", "1",
            "--seed", "1", "--no-progress", "--admit-min-count", "2",
            "--autocast", "off"]  # fp32: ranks match one process to 1e-6 (bf16 drifts)


def _rows(out: Path) -> dict[int, dict]:
    return {r["trial"]: r for r in json.loads((out / "results.json").read_text())["trials"]}


def _one_process_and_two_ranks(argv: list[str], tmp_path: Path) -> tuple[Path, Path]:
    """The same search in one process (``one``) and on 2 torchrun ranks (``two``)."""
    one, two = tmp_path / "one", tmp_path / "two"
    done = _run([sys.executable, "-m", "terarec", *argv, "--out", str(one)])
    assert done.returncode == 0, done.stderr[-3000:]
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(free_port()), "-m", "terarec", *argv,
                 "--out", str(two)])
    assert done.returncode == 0, done.stderr[-3000:]
    return one, two


def test_two_ranks_search_like_one_process(args, tmp_path):
    one, two = _one_process_and_two_ranks(args, tmp_path)
    a, b = _rows(one), _rows(two)
    assert a.keys() == b.keys() == {0, 1, 2}
    assert any(r["state"] == "pruned" for r in a.values())
    for n in a:
        assert b[n]["state"] == a[n]["state"] and b[n]["passes"] == a[n]["passes"]
        assert {k: v for k, v in b[n].items() if k.startswith("params.")} == \
            {k: v for k, v in a[n].items() if k.startswith("params.")}
        assert b[n]["value"] == pytest.approx(a[n]["value"], abs=1e-6)
    best = two / "best"
    name = best_checkpoint(best)
    assert name is not None
    shards = sorted(p.name for p in (best / "checkpoints" / name).glob("sparse-*"))
    assert shards == ["sparse-00000-of-00002", "sparse-00001-of-00002"]
    scores = tmp_path / "scores.json"
    assert _run([sys.executable, "-m", "terarec", "eval", "--model", str(best), "--data",
                 args[args.index("--valid") + 1], "--out", str(scores)]).returncode == 0
    winner = _rows(one)[json.loads((one / "results.json").read_text())["best_trial"]]
    assert json.loads(scores.read_text())["logloss"] == pytest.approx(winner["value"],
                                                                      abs=1e-5)
    # the best pass ends no epoch: on both sides the refit is skipped, saying why
    refits = [json.loads((side / "best" / "metrics.json").read_text())["refit"]
              for side in (one, two)]
    assert refits[0] == refits[1] == {"skipped": "no whole-epoch best pass to refit to"}


@pytest.mark.slow
def test_two_ranks_refit_the_best_trial_as_one_process(args, tmp_path):
    """Small data: the best trial is trained again on train + valid, on 2 ranks as in
    one process (one pass an epoch, so every pass ends an epoch)."""
    argv = [*args, "--pass-rows", "3000", "--trials", "2", "--pruner", "none"]
    one, two = _one_process_and_two_ranks(argv, tmp_path)
    loglosses = []
    for side in (one, two):
        metrics = json.loads((side / "best" / "metrics.json").read_text())
        assert metrics["refit"]["checkpoint"] == best_checkpoint(side / "best")
        assert metrics["refit"]["rows"] % 4000 == 0  # whole epochs of train + valid
        scores = side / "scores.json"
        assert _run([sys.executable, "-m", "terarec", "eval", "--model", str(side / "best"),
                     "--data", args[args.index("--valid") + 1], "--out",
                     str(scores)]).returncode == 0
        loglosses.append(json.loads(scores.read_text())["logloss"])
    assert loglosses[1] == pytest.approx(loglosses[0], abs=1e-5)


def test_a_searched_batch_size_trains_on_two_ranks_as_in_one_process(args, tmp_path):
    """Trials whose batch size differs from the first's get the pass dealt again for
    theirs (``redeal``): the same values as one process re-batching it."""
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"batch_size": [100, 250, 500]}))
    grid = [*args, "--sampler", "grid", "--space", str(space), "--pruner", "none"]
    one, two = _one_process_and_two_ranks(grid, tmp_path)
    a, b = _rows(one), _rows(two)
    assert {r["params.batch_size"] for r in a.values()} == {100, 250, 500}
    assert len({r["value"] for r in a.values()}) == 3  # the batch size matters
    for n in a:
        assert b[n]["params.batch_size"] == a[n]["params.batch_size"]
        assert b[n]["passes"] == a[n]["passes"]
        assert b[n]["value"] == pytest.approx(a[n]["value"], abs=1e-6)


def test_a_batch_size_that_does_not_divide_by_the_ranks_is_refused(args, tmp_path):
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"batch_size": [250, 375]}))
    done = _run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                 "--master_port", str(free_port()), "-m", "terarec", *args, "--space",
                 str(space), "--out", str(tmp_path / "o")])
    assert done.returncode != 0
    assert "batch_size: choices [375] are not multiples of 2" in done.stderr
    assert not (tmp_path / "o" / "trials").exists()  # refused before any trial trained


def _workers(agent: int) -> list[int]:
    """The worker processes torchrun's agent ``agent`` started (rank 0 first)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == agent:
            found.append(int(entry))
    return sorted(found)


@pytest.mark.slow
def test_a_killed_rank_resumes_the_search_with_the_values_of_an_uninterrupted_one(
        args, tmp_path):
    space = tmp_path / "space.json"
    space.write_text(json.dumps({"model.embedding_dim": [2, 4, 8]}))
    grid = [*args, "--sampler", "grid", "--space", str(space), "--parallel", "1",
            "--pruner", "none", "--epochs", "3", "--patience", "10"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    whole, killed = tmp_path / "whole", tmp_path / "killed"
    done = _run([*launch, "--master_port", str(free_port()), "-m", "terarec", *grid,
                 "--out", str(whole)])
    assert done.returncode == 0, done.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    agent = subprocess.Popen([*launch, "--master_port", str(free_port()), "-m", "terarec",
                              *grid, "--out", str(killed)], env=env, start_new_session=True,
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = killed / "trials" / "trial-001" / "LATEST"
    deadline = time.monotonic() + TIMEOUT_S
    while not second.exists() and agent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    assert second.exists(), "the search ended before trial 1 committed a pass"
    os.kill(_workers(agent.pid)[0], signal.SIGKILL)  # rank 0, while trial 1 trains
    assert agent.wait(timeout=TIMEOUT_S) != 0  # torchrun stops the other rank
    assert not (killed / "results.json").exists()
    done = _run([*launch, "--master_port", str(free_port()), "-m", "terarec", *grid,
                 "--out", str(killed), "--resume"])
    assert done.returncode == 0, done.stderr[-3000:]
    want = {r["params.model.embedding_dim"]: r["value"] for r in _rows(whole).values()}
    rows = _rows(killed)
    assert sorted(rows) == [0, 1, 2]  # trial 1 continued from a pass both ranks committed
    metrics = json.loads((killed / "trials" / "trial-001" / "metrics.json").read_text())
    assert metrics["continued_from"].startswith("pass-")
    got = {r["params.model.embedding_dim"]: r["value"] for r in rows.values()}
    assert got.keys() == want.keys() == {2, 4, 8}
    for dim, value in want.items():
        assert got[dim] == pytest.approx(value, abs=1e-12), dim


def test_two_ranks_search_with_feature_tables_like_one_process(tmp_path):
    """``search --features`` under torchrun: rank 0 installs the tables, every rank joins
    its inputs, and the trials score as in one process; the best model carries the
    tables, so its eval on the raw validation file repeats the value that picked it."""
    from terarec.autofeature import Candidate, compute_tables
    from terarec.autofeature.features import FeatureConfig, model_features
    from terarec.data.synth_features import generate_planted

    data = generate_planted(tmp_path / "t.csv", tmp_path / "v.csv", 3000, 1000, seed=4)
    tables = compute_tables([Candidate("count", ("C3",)), Candidate("cross_count",
                                                                    ("C5", "C7"))],
                            data.train, data.schema, tmp_path / "tables")
    FeatureConfig(data.schema, tables).save(tmp_path / "features.json")
    argv = ["search", "--features", str(tmp_path / "features.json"), "--train",
            str(data.train), "--valid", str(data.valid), "--model", "lr", "--trials", "2",
            "--sampler", "random", "--pruner", "none", "--epochs", "2", "--batch-size",
            "250", "--pass-rows", "500", "--threads", "1", "--seed", "1", "--no-progress",
            "--no-refit", "--autocast", "off"]
    one, two = _one_process_and_two_ranks(argv, tmp_path)
    a, b = _rows(one), _rows(two)
    assert a.keys() == b.keys() == {0, 1}
    for n in a:
        assert b[n]["value"] == pytest.approx(a[n]["value"], abs=1e-6)
    features = model_features(two / "best")
    assert features is not None and list(features.selected) == list(tables.names)
    scores = tmp_path / "scores.json"
    assert _run([sys.executable, "-m", "terarec", "eval", "--model", str(two / "best"),
                 "--data", str(data.valid), "--out", str(scores)]).returncode == 0
    winner = b[json.loads((two / "results.json").read_text())["best_trial"]]
    assert json.loads(scores.read_text())["logloss"] == pytest.approx(winner["value"],
                                                                      abs=1e-5)


def test_two_ranks_choose_the_small_data_start_as_one_process(tmp_path):
    """``train`` on small data with --valid chooses Adagrad's start with this loop: on 2
    ranks the same two runs, validation values and choice as in one process."""
    generate(tmp_path / "t.tsv", 1200, model_seed=2, sample_seed=1)
    generate(tmp_path / "v.tsv", 400, model_seed=2, sample_seed=2)
    argv = ["train", "--train", str(tmp_path / "t.tsv"), "--valid", str(tmp_path / "v.tsv"),
            "--model", "lr", "--patience", "1", "--threads", "1", "--seed", "1",
            "--no-progress", "--no-refit", "--autocast", "off"]
    one, two = _one_process_and_two_ranks(argv, tmp_path)
    a, b = (json.loads((d / "metrics.json").read_text())["chosen_by_validation"][0]
            for d in (one, two))
    assert b["chosen"] == a["chosen"]
    for x, y in zip(a["validation"], b["validation"], strict=True):
        assert y["value"] == x["value"] and y["best"] == pytest.approx(x["best"], abs=1e-5)
    assert not (two / "choosing").exists()
