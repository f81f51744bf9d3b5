"""``meta.json``, the manifest rank 0 writes last into a checkpoint: what restoring relies
on, validated on read, and the sha256 of every file, checked before a file is used."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, with_config
from typing_extensions import NotRequired, TypedDict

from terarec.io import sha256_file
from terarec.modeldir.layout import META_FILE, CheckpointError
from terarec.validation import validate_json


@with_config(ConfigDict(extra="allow", strict=True, allow_inf_nan=False))
class _RngState(TypedDict):
    torch: list[Annotated[int, Field(ge=0, le=255)]]


@with_config(ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
class _FileMark(TypedDict):
    rows: Annotated[int, Field(ge=0)]
    done: bool
    size: Annotated[int, Field(ge=0)]
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    skipped: NotRequired[Annotated[int, Field(ge=0)]]


@with_config(ConfigDict(extra="forbid", strict=True, allow_inf_nan=False))
class _Inputs(TypedDict):
    """Row positions per input file (``data.positions.Positions``)."""

    epoch: Annotated[int, Field(ge=0)]
    files: dict[str, _FileMark]


@with_config(ConfigDict(extra="allow", strict=True, allow_inf_nan=False))
class CheckpointMeta(TypedDict):
    """The keys of ``meta.json`` that restoring relies on (writers may add others)."""

    pass_id: Annotated[int, Field(ge=0)]
    sha256: dict[str, Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]]
    rng: _RngState
    history: NotRequired[list[dict[str, Any]]]
    sparse_format: NotRequired[Literal["arrays", "tiered"]]
    sparse_shards: NotRequired[list[str]]
    world_size: NotRequired[Annotated[int, Field(ge=1)]]
    inputs: NotRequired[_Inputs]


def verify_checkpoint(path: Path) -> dict:
    """Return the checkpoint's meta after validating it (``CheckpointMeta``) and checking
    every file's checksum."""
    meta = checkpoint_meta(path)
    verify_files(path, meta, sorted(meta["sha256"]))
    return meta


def checkpoint_meta(path: Path) -> dict:
    """The checkpoint's ``meta.json``, validated (``CheckpointMeta``); files unchecked."""
    meta_path = path / META_FILE
    if not meta_path.exists():
        raise CheckpointError(f"{path}: half-written checkpoint (no meta.json)")
    try:
        return dict(validate_json(CheckpointMeta, meta_path.read_bytes(), str(meta_path),
                                  root="meta"))
    except ValueError as exc:
        raise CheckpointError(f"corrupted checkpoint: {exc}") from None


def verify_files(path: Path, meta: dict, names: list[str]) -> None:
    """Files ``names`` of the checkpoint at ``path`` exist and match their sha256."""
    for fname in names:
        fpath = path / fname
        if not fpath.exists():
            raise CheckpointError(f"{fpath}: missing from checkpoint")
        if sha256_file(fpath) != meta["sha256"][fname]:
            raise CheckpointError(f"{fpath}: checksum mismatch, the file is corrupted")
