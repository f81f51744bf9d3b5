"""Names in a model directory: its metadata files, checkpoint and shard folders, and the
``LATEST`` / ``BEST`` pointers; which checkpoint a name or ``best`` / ``latest`` picks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from terarec.config import TrainConfig, load_train_config, to_dict
from terarec.io import atomic_write_text, write_text_if_changed
from terarec.types import FeatureSchema

KEEP_CHECKPOINTS = 2
LATEST_FILE = "LATEST"
BEST_FILE = "BEST"
SCHEMA_FILE = "schema.json"
TRAIN_CONFIG_FILE = "train_config.json"
CHECKPOINTS_DIR = "checkpoints"
META_FILE = "meta.json"  # a checkpoint's manifest, written last: its commit mark


class CheckpointError(ValueError):
    """A checkpoint that is missing, half-written or corrupted."""


def write_model_meta(model_dir: Path, schema: FeatureSchema, config: TrainConfig) -> None:
    """The model's schema and configuration, written with every checkpoint (rewritten
    only where they changed)."""
    model_dir.mkdir(parents=True, exist_ok=True)
    write_text_if_changed(model_dir / SCHEMA_FILE, schema.json_text)
    write_train_config(model_dir, config)


def write_train_config(model_dir: Path, config: TrainConfig) -> None:
    """``model_dir/train_config.json``, what ``read_model_meta`` reads back."""
    write_text_if_changed(model_dir / TRAIN_CONFIG_FILE,
                          json.dumps(to_dict(config), indent=2))


def read_model_meta(model_dir: str | Path) -> tuple[FeatureSchema, TrainConfig]:
    """The schema and training configuration a model directory was trained with."""
    model_dir = Path(model_dir)
    if not (model_dir / SCHEMA_FILE).exists():
        raise CheckpointError(f"{model_dir}: not a terarec model directory (no schema.json)")
    schema = FeatureSchema.load(model_dir / SCHEMA_FILE)
    if not (model_dir / TRAIN_CONFIG_FILE).exists():
        raise CheckpointError(f"{model_dir}: train_config.json is missing")
    return schema, load_train_config(model_dir / TRAIN_CONFIG_FILE)


def pass_name(pass_id: int) -> str:
    """The folder of the checkpoint committed after pass ``pass_id``."""
    return f"pass-{pass_id:06d}"


def shard_name(rank: int, world: int) -> str:
    """Rank ``rank``'s sparse shard: the folder its store saves itself into."""
    return "sparse" if world == 1 else f"sparse-{rank:05d}-of-{world:05d}"


def comm_file(rank: int, world: int) -> str:
    """Rank ``rank``'s unsent DGC residuals."""
    return f"dense_comm-{rank:05d}-of-{world:05d}.pt"


def list_checkpoints(model_dir: str | Path) -> list[Path]:
    """Committed checkpoints, newest first."""
    root = Path(model_dir) / CHECKPOINTS_DIR
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith("pass-")),
                  reverse=True)


def mark_best(model_dir: str | Path, name: str) -> None:
    """Point ``BEST`` at committed checkpoint ``name`` (atomically)."""
    model_dir = Path(model_dir)
    if not (model_dir / CHECKPOINTS_DIR / name / META_FILE).exists():
        raise CheckpointError(f"{model_dir}: no committed checkpoint {name} to mark best")
    atomic_write_text(model_dir / BEST_FILE, name)


def best_checkpoint(model_dir: str | Path) -> str | None:
    """The checkpoint ``BEST`` names, or None when there is none."""
    path = Path(model_dir) / BEST_FILE
    if not path.exists():
        return None
    return path.read_text().strip() or None


def clear_best(model_dir: str | Path) -> None:
    """Forget ``BEST`` (a fresh run into a directory an older run left one in)."""
    (Path(model_dir) / BEST_FILE).unlink(missing_ok=True)


def checkpoint_name(model_dir: str | Path, which: str = "best") -> str | None:
    """The checkpoint ``which`` selects: ``best`` (``BEST``, else the newest), ``latest``
    (None: the newest that verifies) or a name such as ``pass-3`` / ``pass-000003``."""
    if which == "latest":
        return None
    if which == "best":
        best = best_checkpoint(model_dir)
        # A name that is no checkpoint folder was reported as a half-written checkpoint.
        if best is not None and not (best.startswith("pass-") and best[5:].isdigit() and (
                Path(model_dir) / CHECKPOINTS_DIR / best).is_dir()):
            have = ", ".join(p.name for p in list_checkpoints(model_dir)) or "none"
            raise CheckpointError(f"{Path(model_dir) / BEST_FILE} names {best!r}, which is "
                                  f"not a checkpoint here (have: {have}); --checkpoint "
                                  "latest or pass-N picks one")
        return best
    if which.startswith("pass-") and which[5:].isdigit():
        name = pass_name(int(which[5:]))
        if not (Path(model_dir) / CHECKPOINTS_DIR / name).is_dir():
            have = ", ".join(p.name for p in list_checkpoints(model_dir)) or "none"
            raise CheckpointError(f"{model_dir}: no checkpoint {name} (have: {have})")
        return name
    raise ValueError(f"--checkpoint {which!r}: expected latest, best or pass-N")


def prune_checkpoints(ckpt_root: Path, keep: int = KEEP_CHECKPOINTS,
                      pinned: str | None = None) -> None:
    """Drop all but the newest ``keep`` checkpoints, never the one ``BEST`` names nor
    ``pinned``."""
    done = sorted(p for p in ckpt_root.iterdir() if p.is_dir() and p.name.startswith("pass-"))
    kept = {best_checkpoint(ckpt_root.parent), pinned}
    for old in done[:-keep]:
        if old.name not in kept:
            shutil.rmtree(old, ignore_errors=True)
    for tmp in ckpt_root.glob(".pass-*"):
        shutil.rmtree(tmp, ignore_errors=True)
