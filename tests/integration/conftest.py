from pathlib import Path

import pytest

from terarec.data.synth import generate

SHARED_DATA = Path(__file__).resolve().parents[2] / ".." / "shared" / "data"


@pytest.fixture(scope="session")
def synth_files(tmp_path_factory):
    """A small synthetic train/valid pair sharing one ground truth."""
    root = tmp_path_factory.mktemp("synth")
    train = generate(root / "train.tsv", 200_000, model_seed=7, sample_seed=1)
    valid = generate(root / "valid.tsv", 30_000, model_seed=7, sample_seed=2)
    return root / "train.tsv", root / "valid.tsv", train, valid


@pytest.fixture
def criteo_sample(tmp_path):
    path = SHARED_DATA / "criteo-kaggle-sample" / "train-10k.txt"
    if not path.exists():
        pytest.skip("../shared/data is absent")
    lines = path.read_text().splitlines(keepends=True)
    train, valid = tmp_path / "train.txt", tmp_path / "valid.txt"
    train.write_text("".join(lines[:8000]))
    valid.write_text("".join(lines[8000:]))
    return train, valid
