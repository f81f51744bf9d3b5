"""A checkpoint that does not fit on the model directory's filesystem is one error naming
it, its staging folder is removed, and the checkpoints before it still load."""

from __future__ import annotations

import subprocess

import pytest

from terarec.cli.main import main
from terarec.data.synth import generate


@pytest.fixture
def small_fs(tmp_path):
    """A 3 MB filesystem of its own (tmpfs: mounting needs root, else the test skips)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


def test_checkpoint_on_a_full_disk_is_one_error(tmp_path, small_fs, capsys):
    data = tmp_path / "train.tsv"
    generate(data, 6000, model_seed=1, sample_seed=2)
    out = small_fs / "model"
    rc = main(["train", "--train", str(data), "--out", str(out), "--memory-budget", "8MB",
               "--store-dir", str(tmp_path / "store"), "--embedding-dim", "32",
               "--pass-rows", "3000", "--no-progress", "--threads", "1",
               "--valid-split", "0"])  # (carved copies would fill the small disk first)
    assert rc == 2
    err = capsys.readouterr().err
    assert "cannot write checkpoint" in err and "no space left on device" in err
    assert not [p for p in (out / "checkpoints").iterdir() if p.name.startswith(".")]
