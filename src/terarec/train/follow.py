"""``terarec train --follow SOURCE``: train the files of a folder or fsspec URI in name
order as they land, pass by pass, until stopped.

When a file counts as landed (docs/continuous.md):

* a file directly under SOURCE is landed once it is visible under its final name: a
  writer writes it under a name the follower ignores (starting with ``.`` or ``_``, or
  ending in ``.tmp``, ``.part``, ``.partial`` or ``.inprogress``) and renames it into
  place (atomic on a local filesystem; an object store's PUT is atomic by itself);
* a folder under SOURCE (a partition of several files) is landed once it holds a
  ``_SUCCESS`` marker; its files are then trained in name order.

A file taken for training that a later listing shows with another size was written in
place, not renamed: the run stops naming it (``GrownFileError``) rather than lose the rows
it gained. Names ending in ``.json`` (metadata such as ``terarec synth``'s ground truth)
are never data. A landed file with no data rows (zero bytes, a header only, a Parquet file of no
rows: an empty partition's part file) is trained as zero rows and recorded as done.
Files of an object store are copied into ``OUT/follow-cache`` to be read and the copy
removed once every rank has read it; checkpoints name them by their URI.

With AutoFeature tables (``FollowOptions.prepare``) each landed file is joined with them
into a Parquet copy under ``OUT/follow-cache/_prepared`` (raw columns and features, the
rows in file order), which training reads and which is removed once every rank has read
it; checkpoints still name the landed file and record its fingerprint, not the copy's.
A file with no data rows is not joined: it is trained as zero rows.

Under torchrun, rank 0 lists SOURCE (and copies new files) and broadcasts the list in
the read-ahead thread's process group, so every rank reads the same files in the same
order and splits each one (``data.split``); ``OUT`` must then be on a filesystem every
rank sees, as for checkpoints.
"""

from __future__ import annotations

import contextlib
import logging
import posixpath
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from terarec.data.positions import IDLE, Idle, InputFile, Positions, fingerprint, input_key
from terarec.data.readers import DataError, no_data_rows
from terarec.distributed.context import DistContext
from terarec.export.storage import Storage
from terarec.io import atomic_write_bytes, atomic_write_text
from terarec.types import FeatureSchema

log = logging.getLogger(__name__)

SUCCESS = "_SUCCESS"
_IN_PROGRESS = (".tmp", ".part", ".partial", ".inprogress")
CACHE_DIR = "follow-cache"
# Under CACHE_DIR: the prepared copies, and first_landed's (per process). Landed names
# never start with "_", so neither can clash with an object store file's copy.
PREPARED_DIR = "_prepared"
_FIRST_PREFIX = "_first-"
METRICS_FILE = "metrics.prom"


@dataclass(frozen=True)
class Prepare:
    """How a landed file becomes the file training reads (``--features``: joined with the
    model's AutoFeature tables): ``schema`` reads the landed file, ``write(landed, copy)``
    writes the copy. It must hold the same rows in the same order each time it is made,
    as a resumed run continues inside it."""

    schema: FeatureSchema
    write: Callable[[Path, Path], object]


@dataclass
class FollowOptions:
    """Where to follow and when to stop (``stop_after``: once that many files of the
    model directory are trained, earlier runs included; ``stop_idle_s``: once no new file
    has landed for that long); both None: run until SIGTERM."""

    source: str
    storage_options: dict[str, Any] | None = None
    poll_s: float = 1.0
    stop_after: int | None = None
    stop_idle_s: float | None = None
    prepare: Prepare | None = None  # each landed file made into the file training reads


def is_data_name(name: str) -> bool:
    """Whether a name under SOURCE can be a landed data file (see the module docstring)."""
    return not (name.startswith((".", "_")) or name.endswith(_IN_PROGRESS)
                or name.endswith(".json"))


class FollowSource:
    """The landed files under one folder or URI, in name order."""

    def __init__(self, options: FollowOptions, cache: Path) -> None:
        self.storage = Storage(options.source, options.storage_options)
        self.cache = cache
        self.prepare = options.prepare

    def landed(self) -> list[str]:
        """Landed files, relative to SOURCE, in name order (partition folders expanded)."""
        return list(self.landed_sizes())

    def landed_sizes(self) -> dict[str, int | None]:
        """Landed files (as ``landed``) and their sizes in bytes as listed."""
        out: dict[str, int | None] = {}
        for name, is_dir, size in self._entries(""):
            if not is_data_name(name):
                continue
            if not is_dir:
                out[name] = size
                continue
            inner = self._entries(name)
            if any(n == SUCCESS for n, _, _ in inner):
                out.update((f"{name}/{n}", s) for n, d, s in inner
                           if not d and is_data_name(n))
        return out

    def _entries(self, rel: str) -> list[tuple[str, bool, int | None]]:
        fs = self.storage.fs
        try:
            entries = fs.ls(self.storage.path(rel), detail=True, refresh=True) \
                if not self.storage.is_local else fs.ls(self.storage.path(rel), detail=True)
        except FileNotFoundError:
            return []
        return sorted((posixpath.basename(str(e["name"]).rstrip("/")),
                       e.get("type") == "directory",
                       None if e.get("size") is None else int(e["size"])) for e in entries)

    def key(self, rel: str) -> str:
        """How checkpoints name the file: its absolute path, or its URI."""
        local = self.storage.local_path(rel)
        if local is not None:
            return input_key(local)
        return f"{self.storage.uri.rstrip('/')}/{rel}"

    def fetch(self, rel: str, into: Path | None = None, *, announce: bool = True) -> InputFile:
        """The file as a local input: an object store's file copied into the cache, and
        with ``prepare``, the prepared copy (``into``: the folder for the copies instead
        of the cache, every copy but the prepared one removed before returning).
        ``announce``: log the landing (once per file: not when ``first_landed`` reads the
        first file for its statistics before the loop takes it)."""
        local = self.storage.local_path(rel)
        if local is not None:
            # Fingerprinted now: the size checkpoints record is the one ``follow_inputs``
            # compares later listings with.
            item = InputFile(input_key(local), local, empty_ok=True,
                             fingerprint=fingerprint(local))
        else:
            dest = (into or self.cache) / rel
            if not dest.exists():
                self.storage.download(rel, dest)
            item = InputFile(self.key(rel), dest, empty_ok=True, fingerprint=fingerprint(dest))
        if announce:
            log.info("landed %s (%d bytes)", rel, (item.fingerprint or (0,))[0])
        if self.prepare is None:
            return item
        return self._prepared(item, (into or self.cache) / PREPARED_DIR / rel)

    def _prepared(self, item: InputFile, copy: Path) -> InputFile:
        """``item`` read from its prepared copy at ``copy`` (made again even if there is
        one: a run that failed may have left it from other tables)."""
        assert self.prepare is not None
        # taken first: the file the copy was made from
        landed = item.fingerprint or fingerprint(item.path)
        if no_data_rows(item.path, self.prepare.schema):
            atomic_write_bytes(copy, b"")  # zero bytes: read as zero rows in any format
        else:
            self.prepare.write(item.path, copy)
        if self.cached(item):  # an object store file's copy: the prepared one replaces it
            item.path.unlink(missing_ok=True)
        return InputFile(item.key, copy, empty_ok=True, fingerprint=landed)

    def cached(self, item: InputFile) -> bool:
        return self.cache in item.path.parents


def remove_first_leftovers(cache: Path) -> None:
    """Remove the folders ``first_landed`` left under ``cache`` when a run was killed
    while taking its statistics; call before any rank of the new run takes them."""
    if cache.is_dir():
        for old in cache.glob(_FIRST_PREFIX + "*"):
            shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def first_landed(options: FollowOptions, cache: Path,
                 schema: FeatureSchema) -> Iterator[InputFile]:
    """The first file under the source with data rows (read with ``schema``; waits for
    one): a fresh model's numeric statistics come from it. A file with none (an empty
    partition's part file) has no statistics to give, and stopped the run with "no data
    rows" although the loop trains it as zero rows: the next file is taken. ``stop_idle_s``
    bounds the wait too: without such a file there is no model to start. Fetched, and with
    ``prepare`` prepared, in a folder of this process's own (every rank takes the
    statistics), removed on exit."""
    source = FollowSource(replace(options, prepare=None), cache)
    prepared = FollowSource(options, cache)
    started = time.monotonic()
    checked: set[str] = set()
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=_FIRST_PREFIX, dir=cache) as own:
        while True:
            for rel in source.landed():
                if rel in checked:
                    continue
                checked.add(rel)
                item = source.fetch(rel, into=Path(own), announce=False)
                if no_data_rows(item.path, schema):
                    if source.cached(item):
                        item.path.unlink(missing_ok=True)
                    continue
                if options.prepare is not None:
                    item = prepared._prepared(item, Path(own) / PREPARED_DIR / rel)
                yield item
                return
            if options.stop_idle_s is not None \
                    and time.monotonic() - started >= options.stop_idle_s:
                what = "no file with data rows" if checked else "no file"
                raise ValueError(f"--follow {options.source}: {what} landed within "
                                 f"--stop-idle {options.stop_idle_s:g} s; nothing was "
                                 "trained")
            time.sleep(options.poll_s)


def _broadcast(ctx: DistContext, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank, in the read-ahead thread's process group."""
    if ctx.world == 1:
        return obj
    box = [obj]
    with torch.cuda.device(ctx.device) if ctx.backend == "nccl" else nullcontext():
        dist.broadcast_object_list(box, src=0, group=ctx.plan_group)
    return box[0]


class GrownFileError(DataError):
    """A landed file changed size after it was taken for training: it was written in
    place, not renamed into place, and rows of it would be lost or trained twice."""


def grown_files(source: FollowSource, listed: dict[str, int | None],
                taken: dict[str, int]) -> str | None:
    """Why the run must stop when a file taken for training (``taken``: key -> size
    recorded) is listed with another size; None when none is."""
    for rel, size in listed.items():
        key = source.key(rel)
        if size is None or key not in taken or taken[key] == size:
            continue
        return (f"--follow {source.storage.uri}: {rel} changed after it was taken for "
                f"training ({taken[key]} -> {size} bytes): it is being written in place, "
                "so the rows it gained would never be trained. Land files by writing "
                "them under a temporary name (.NAME.tmp) and renaming them into place; "
                f"to go on, move {rel} aside, land the rows it gained as a new file, "
                "and run again with --resume")
    return None


def follow_inputs(source: FollowSource, ctx: DistContext, start: Positions,
                  poll_s: float, stop: threading.Event) -> Iterator[InputFile | Idle]:
    """The landed files not yet trained (``start``: the checkpoint's positions), as they
    land, and IDLE after every listing that found nothing new; ends once ``stop`` is set.
    Runs in the read-ahead thread: on N ranks rank 0 lists and every rank follows.

    A file taken for training (in ``start`` or since) that is later listed with another
    size was written in place: ``GrownFileError`` on every rank, never silent loss."""
    taken: dict[str, int] = {k: m.size for k, m in start.files.items()}
    sent: set[str] = {k for k, m in start.files.items() if m.done}
    read: list[InputFile] = []  # yielded before the last listing: read by every rank now
    while True:
        found: list[InputFile] | str | None = None
        if ctx.is_main:
            if stop.is_set():
                found = []
            else:
                listed = source.landed_sizes()
                found = grown_files(source, listed, taken) or [
                    source.fetch(rel) for rel in listed if source.key(rel) not in sent]
        found = _broadcast(ctx, None if stop.is_set() and ctx.is_main else found)
        if ctx.is_main:  # the copies every rank has read by now
            for item in read:
                if source.cached(item):
                    item.path.unlink(missing_ok=True)
        read = []
        if found is None:
            return
        if isinstance(found, str):
            raise GrownFileError(found)
        for item in found:
            sent.add(item.key)
            if item.fingerprint is not None:
                taken[item.key] = item.fingerprint[0]
            read.append(item)
            yield item
        if not found:
            yield IDLE
            stop.wait(poll_s)


class StopSignal:
    """SIGTERM (and SIGINT) ask the run to stop at the next pass boundary; installed in
    the main thread only, the previous handlers restored on ``close``."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.requested = True

    def close(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}


class FollowStop:
    """Whether the run stops now: SIGTERM, ``stop_after`` files trained or ``stop_idle_s``
    without a new file, on any rank (collective: every rank calls it at the same
    points and gets the same answer)."""

    def __init__(self, options: FollowOptions, trainer: Any, signal_: StopSignal) -> None:
        self.options, self.trainer, self.signal = options, trainer, signal_
        self._last_new = time.monotonic()
        self._rows = -1
        self.reason: str | None = None

    def __call__(self) -> bool:
        positions = Positions.from_dict(self.trainer.inputs)
        if positions.rows != self._rows:
            self._rows, self._last_new = positions.rows, time.monotonic()
        o = self.options
        reasons = [self.signal.requested,
                   o.stop_after is not None and positions.done_files >= o.stop_after,
                   o.stop_idle_s is not None
                   and time.monotonic() - self._last_new >= o.stop_idle_s]
        agreed = self.trainer.ctx.all_sum([float(r) for r in reasons])
        for name, value in zip(("signal", "stop_after", "stop_idle"), agreed, strict=True):
            if value > 0:
                self.reason = name
                return True
        return False


def write_prometheus(path: Path, trainer: Any, landed_s: float | None = None) -> None:
    """The run's figures in the Prometheus text format (a node-exporter textfile),
    rewritten atomically after every pass."""
    from terarec.train.progressive import progressive_summary

    history = trainer.history
    positions = Positions.from_dict(trainer.inputs)
    last = history[-1] if history else {}
    summary = progressive_summary(history)
    gauges: list[tuple[str, str, float | int | None]] = [
        ("terarec_passes_total", "passes trained", trainer.pass_id),
        ("terarec_rows_trained_total", "rows trained (input positions)", positions.rows),
        ("terarec_files_trained_total", "input files trained to their end",
         positions.done_files),
        ("terarec_last_pass_timestamp_seconds", "when the last pass ended", time.time()),
        ("terarec_pass_train_loss", "training loss of the last pass", last.get("train_loss")),
        ("terarec_progressive_auc", "AUC of the last pass, scored before training it",
         last.get("progressive_auc")),
        ("terarec_progressive_logloss", "logloss of the last pass, scored before training",
         last.get("progressive_logloss")),
        ("terarec_progressive_auc_mean", "row-weighted mean of the per-file progressive AUC",
         summary["progressive_auc"]),
        ("terarec_progressive_logloss_mean", "row-weighted mean of the per-file logloss",
         summary["progressive_logloss"]),
    ]
    lines = []
    for name, help_, value in gauges:
        if value is None:
            continue
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {value:.10g}"]
    atomic_write_text(path, "\n".join(lines) + "\n")
