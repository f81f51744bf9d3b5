"""How far into each input file a run has trained: what a checkpoint records, so that a
resumed run trains every row exactly once per epoch.

A pass count cannot say where to continue once the inputs, ``--pass-rows`` or
``--batch-size`` differ from the run that wrote the checkpoint; a row position per file
can. ``Positions`` maps each input file (by ``input_key``) to a ``FileMark``: the rows
consumed, whether the file is done, and the file's size and a checksum of its first and
last MiB, so that a file that changed since it was consumed is refused by name.

Rows are data rows in file order (lines after the header of a text file, rows of a
Parquet file). With ``--on-bad-row skip`` a single process counts the rows it kept and
torchrun ranks count lines (the two agree whenever no row was skipped); a mark records
how many bad rows a single process skipped, and a position after skipped rows is found
by reading the file from its start.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from terarec.data.readers import DataError
from terarec.types import Batch

_FINGERPRINT_BYTES = 1 << 20  # the head and the tail of a file hashed


@dataclass(frozen=True)
class InputFile:
    """An input: ``key`` names it in checkpoints (an absolute path, or the URI it was
    fetched from), ``path`` is the local file read; ``empty_ok``: a file with no data
    rows is read as zero rows rather than refused (a followed source's empty partition,
    ``readers.no_data_rows``); ``fingerprint``: what checkpoints record of the file
    (None: ``path``'s), given where ``path`` is a copy made from it (joined with
    AutoFeature tables), so that a resumed run checks the file itself, whose copy is
    made again with the same rows but maybe not the same bytes."""

    key: str
    path: Path
    empty_ok: bool = False
    fingerprint: tuple[int, str] | None = None


class Idle:
    """Marks a moment with no new input (``train --follow`` waiting for files): the pass
    loop gets a chance to export on the clock and to stop. ``positions``: the inputs'
    positions when files with no rows were finished since the last pass (no pass
    carries them, yet they are trained, as zero rows, and count as done)."""

    def __init__(self, positions: Positions | None = None) -> None:
        self.positions = positions

    def __repr__(self) -> str:
        return "IDLE"


IDLE = Idle()


def as_input(item: str | Path | InputFile) -> InputFile:
    """An input file from a path (keyed by its absolute path) or an ``InputFile``."""
    if isinstance(item, InputFile):
        return item
    return InputFile(input_key(item), Path(item))


def keyed_inputs(items: Iterable[Any]) -> Iterator[InputFile | Idle]:
    """``items`` as input files (IDLE passed through); a file listed again is a further
    input (trained again), keyed ``path#2``, ``path#3``, ..."""
    seen: dict[str, int] = {}
    for entry in items:
        if isinstance(entry, Idle):
            yield entry
            continue
        item = as_input(entry)
        n = seen[item.key] = seen.get(item.key, 0) + 1
        yield item if n == 1 else replace(item, key=f"{item.key}#{n}")


def input_key(path: str | Path) -> str:
    """The name checkpoints give a local input: its absolute path."""
    return os.path.abspath(os.fspath(path))


def fingerprint(path: str | Path) -> tuple[int, str]:
    """(size, sha256 of the first and last MiB): cheap on any file size, and changed by
    any append, truncation or rewrite of either end."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as fh:
        digest.update(fh.read(_FINGERPRINT_BYTES))
        if size > _FINGERPRINT_BYTES:
            fh.seek(max(size - _FINGERPRINT_BYTES, _FINGERPRINT_BYTES))
            digest.update(fh.read(_FINGERPRINT_BYTES))
    return size, digest.hexdigest()


@dataclass
class FileMark:
    """One input file's consumption: ``rows`` trained, ``done`` once its last row is."""

    rows: int
    done: bool
    size: int
    sha256: str
    skipped: int = 0  # bad rows skipped so far (``--on-bad-row skip``)

    def to_dict(self) -> dict[str, Any]:
        return {"rows": self.rows, "done": self.done, "size": self.size,
                "sha256": self.sha256, "skipped": self.skipped}

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str) -> FileMark:
        try:
            return cls(rows=int(d["rows"]), done=bool(d["done"]), size=int(d["size"]),
                       sha256=str(d["sha256"]), skipped=int(d.get("skipped", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{where}: bad input position {d!r}: {exc}") from None


@dataclass
class Positions:
    """Every input file's mark in the current ``epoch`` (checkpoint meta ``inputs``)."""

    epoch: int = 0
    files: dict[str, FileMark] = field(default_factory=dict)
    _fingerprints: dict[str, tuple[int, str]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "files": {k: m.to_dict() for k, m in self.files.items()}}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None, where: str = "checkpoint") -> Positions:
        if not d:
            return cls()
        files = {str(k): FileMark.from_dict(v, f"{where}: inputs.files[{k!r}]")
                 for k, v in dict(d.get("files", {})).items()}
        return cls(epoch=int(d.get("epoch", 0)), files=files)

    def copy(self) -> Positions:
        return Positions(self.epoch, {k: FileMark(**vars(m)) for k, m in self.files.items()},
                         self._fingerprints)

    @property
    def rows(self) -> int:
        return sum(m.rows for m in self.files.values())

    @property
    def done_files(self) -> int:
        return sum(m.done for m in self.files.values())

    def fingerprint(self, item: InputFile) -> tuple[int, str]:
        """The file's fingerprint, computed once per run."""
        if item.key not in self._fingerprints:
            self._fingerprints[item.key] = item.fingerprint or fingerprint(item.path)
        return self._fingerprints[item.key]

    def start(self, item: InputFile) -> FileMark | None:
        """Where reading ``item`` resumes (None: from its first row); a DataError naming
        the file when it changed since the rows recorded were consumed."""
        mark = self.files.get(item.key)
        if mark is None:
            return None
        size, digest = self.fingerprint(item)
        if size != mark.size or digest != mark.sha256:
            what = (f"size {mark.size} -> {size} bytes" if size != mark.size
                    else "its content checksum differs")
            raise DataError(f"{item.key}: input file changed since {mark.rows} of its rows "
                            f"were trained ({what}); restore the original file or train "
                            "into a new --out")
        return mark

    def advance(self, item: InputFile, rows: int, done: bool, skipped: int = 0) -> None:
        """Record ``rows`` consumed of ``item`` (``done``: all of them)."""
        size, digest = self.fingerprint(item)
        self.files[item.key] = FileMark(rows, done, size, digest, skipped)


@dataclass
class PassInput:
    """What one training pass consumed: every file's position after it, the files it
    read from and those it finished."""

    positions: Positions
    files: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)


def with_last(items: Iterable) -> Iterator[tuple[Any, bool]]:
    """Each item with whether it is the last one (one item of read-ahead)."""
    it = iter(items)
    try:
        current = next(it)
    except StopIteration:
        return
    for following in it:
        yield current, False
        current = following
    yield current, True


# One input file's steps from its mark on (``mark``: None from its first row): each
# step's batch, the rows it moves the file's position by, and the file's bad rows
# skipped so far that its mark records.
FileSteps = Callable[[InputFile, "FileMark | None"], Iterator[tuple[Batch, int, int]]]


def iter_position_passes(items: Iterable[Any], pass_rows: int, positions: Positions,
                         steps: FileSteps, *, per_file: bool = False,
                         agree: Callable[[DataError | None], None] | None = None
                         ) -> Iterator[tuple[list[Batch], PassInput] | Idle]:
    """Passes of at least ``pass_rows`` rows (``per_file``: also ending at every file's
    end) of the rows ``positions`` does not mark consumed, each with its ``PassInput``;
    IDLE in ``items`` is passed through between passes. ``steps`` reads a file: a single
    process's batches or a rank's local batches, whose rows are then the global step's.

    ``agree`` (torchrun ranks) runs once a pass is read, before it is yielded, with the
    DataError this reader met (None: none): the ranks exchange what they read there and
    it raises every rank's first error; it is also called at the end of the input, so
    every rank makes the same calls. Without it an error is raised where it is met."""
    pos = positions.copy()
    stream = _position_steps(items, pos, steps)
    done = False
    carried = pos.to_dict()  # the positions the last pass yielded carried
    while not done:
        current: list[Batch] = []
        info = PassInput(pos)
        rows = 0
        error: DataError | None = None
        idle = False
        try:
            while rows < pass_rows:
                step = next(stream, None)
                if step is None:
                    done = True
                    break
                if isinstance(step, Idle):
                    idle = True
                    break
                key, batch, step_rows, last = step
                current.append(batch)
                rows += step_rows
                if key not in info.files:
                    info.files.append(key)
                if last:
                    info.finished.append(key)
                    if per_file:
                        break
        except DataError as exc:
            if agree is None:
                raise
            error = exc
        if agree is not None and (current or error is not None or not idle):
            agree(error)  # the same calls on every rank
        if current:
            carried = pos.to_dict()
            yield current, PassInput(pos.copy(), info.files, info.finished)
        if idle:
            now = pos.to_dict()
            if now != carried:  # files of no rows finished since: their marks go out too
                carried = now
                yield Idle(pos.copy())
            else:
                yield IDLE


def _position_steps(items: Iterable[Any], pos: Positions, steps: FileSteps
                    ) -> Iterator[tuple[str, Batch, int, bool] | Idle]:
    """Every step of the files (IDLE passed through) from their marks in ``pos`` on, as
    (file key, batch, rows, last step of the file), ``pos`` advanced past each step
    before it is yielded; a file with nothing left is marked done."""
    for entry in keyed_inputs(items):
        if isinstance(entry, Idle):
            yield entry
            continue
        item = entry
        mark = pos.start(item)
        if mark is not None and mark.done:
            continue
        file_rows = mark.rows if mark is not None else 0
        skipped = mark.skipped if mark is not None else 0
        read_any = False
        for (batch, step_rows, skipped), last in with_last(steps(item, mark)):
            read_any = True
            file_rows += step_rows
            pos.advance(item, file_rows, last, skipped)
            yield item.key, batch, step_rows, last
        if not read_any:  # resumed at its end
            pos.advance(item, file_rows, True, skipped)
