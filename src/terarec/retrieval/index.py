"""Item vectors and their approximate nearest-neighbour index (faiss).

``build_index`` streams an item catalog (a file of the item fields' raw values, one item
a row) in batches through the item tower of an exported version (an ``item_tower`` slice,
or a whole DSSM), and indexes the vectors with faiss: ``hnsw`` (a graph, no training) or
``ivfpq`` (coarse clusters and product-quantised codes, a fraction of the memory). The
index lives in a folder of generations, each written whole before ``CURRENT`` names it::

    OUT/CURRENT            name of the served generation (written last)
    OUT/g000002/index.faiss      faiss index; its ids are slots
    OUT/g000002/items.npz        ids (catalog id column), keys [n, I], slot of each item,
                                 and the graph id it is found under (``reps``)
    OUT/g000002/vectors.npy      item vectors [n, K] (exact search, rebuilding)
    OUT/g000002/catalog.parquet  the item fields' raw values (re-embedding)
    OUT/g000002/meta.json        export, version, dense weights' sha256, kind, counts

``update_index`` follows the export: when the newest version extends the indexed one's
chain with deltas that leave the item tower's weights unchanged, only items with a key
whose row changed are embedded again (new slots; the old ones removed from an IVF index,
filtered out of an HNSW graph, which cannot remove); anything else is a full rebuild.

An HNSW graph holds each distinct vector once: items with the same vector (a trained
item tower gives every item it never saw its topic's or its defaults' vector, hundreds of
items alike) made cliques of exact twins that the graph search could not leave
(docs/retrieval.md). A search finds distinct vectors and answers every item that has
one, all with its score.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from terarec.data.hashing import hash_column
from terarec.export.format import Manifest
from terarec.io import atomic_path, atomic_write_text
from terarec.models.dssm import DSSM
from terarec.retrieval.faiss_import import import_faiss
from terarec.retrieval.slices import iter_field_columns, slice_of
from terarec.serving.engine import ServedVersion, ServingEngine
from terarec.serving.features import columns_batch

log = logging.getLogger(__name__)

KINDS = ("hnsw", "ivfpq")
CURRENT = "CURRENT"
EMBED_ROWS = 8192

if TYPE_CHECKING:
    import faiss
else:  # its loader's lines about builds it lacks are debug events, not errors
    faiss = import_faiss()


class IndexFolderError(ValueError):
    """An index folder that is missing, half-written or does not fit its export."""


MAX_PQ_M = 64  # the sized IVF-PQ code's bytes per vector, at most


@dataclass(frozen=True)
class IndexOptions:
    # ivfpq: on a trained item tower's vectors, whose top scores crowd together, it
    # finds far more of the top 100 than a graph at the same speed (docs/retrieval.md)
    kind: str = "ivfpq"
    hnsw_m: int = 32
    ef_construction: int = 80
    ef_search: int = 256
    nlist: int = 0        # ivfpq: clusters (0: about sqrt(n))
    # ivfpq: sub-quantisers, bytes per vector (0: one a dimension, at most MAX_PQ_M):
    # codes of two dimensions a byte order a trained tower's crowded top scores too
    # roughly for refine 8 to recover them (docs/retrieval.md: the curves)
    pq_m: int = 0
    nprobe: int = 8       # ivfpq: of ~sqrt(n) clusters
    refine: int = 8       # ivfpq: candidates re-scored exactly, per item asked for

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"--kind {self.kind!r}: expected one of {KINDS}")
        for name in ("hnsw_m", "ef_construction", "ef_search", "nprobe", "refine"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")
        for name in ("nlist", "pq_m"):  # 0: sized from the data
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, name)}")


def _tower(version: ServedVersion) -> DSSM:
    model = version.model
    info = slice_of(version.manifest)
    if not isinstance(model, DSSM) or (info is not None and info["name"] != "item_tower"):
        what = f"slice {info['name']!r}" if info else f"model {type(model).__name__}"
        raise ValueError(f"{version.name}: item vectors need a dssm export or its "
                         f"item_tower slice, this is {what}")
    return model


def dense_digest(version: ServedVersion) -> str:
    """The sha256 of the item tower's weights: a delta that keeps it needs no rebuild."""
    tower = _tower(version).item_tower.state_dict()
    h = hashlib.sha256()
    for key in sorted(tower):
        h.update(key.encode())
        h.update(tower[key].detach().cpu().numpy().tobytes())
    return h.hexdigest()


@torch.no_grad()
def embed_items(engine: ServingEngine, version: ServedVersion,
                columns: dict[str, pa.Array]) -> np.ndarray:
    """Item vectors ``[n, K]`` (float32) of catalog rows given as raw columns."""
    model = _tower(version)
    n = len(next(iter(columns.values())))
    batch = columns_batch(columns, n, version.schema)
    emb = engine.pooled(batch, version)
    vectors = model.item_embedding(emb.index_select(1, model.item_index)).numpy()
    if not np.isfinite(vectors).all():
        raise ValueError(f"{version.name}: non-finite item vectors; refusing to index them")
    return np.ascontiguousarray(vectors, np.float32)


def _new_index(dim: int, options: IndexOptions, sample: np.ndarray,
               total: int) -> faiss.Index:
    """An empty index of ``options.kind`` (IVF-PQ trained on ``sample`` of ``total``)."""
    if options.kind == "hnsw":
        base = faiss.IndexHNSWFlat(dim, options.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        base.hnsw.efConstruction = options.ef_construction
        base.hnsw.efSearch = options.ef_search
        return faiss.IndexIDMap2(base)
    nlist = options.nlist or max(1, min(len(sample) // 39, int(total ** 0.5)))
    pq_m = options.pq_m or next(m for m in range(min(dim, MAX_PQ_M), 0, -1) if dim % m == 0)
    if pq_m < 1 or dim % pq_m:
        raise ValueError(f"--pq-m {options.pq_m} must divide the vector size {dim}")
    if nlist > len(sample):  # faiss's k-means needs a training vector per cluster at least
        raise ValueError(f"--nlist {nlist}: more clusters than the {len(sample)} items "
                         "sampled to train them")
    quantizer = faiss.IndexFlatIP(dim)
    index = faiss.IndexIVFPQ(quantizer, dim, nlist, pq_m, 8,
                             faiss.METRIC_INNER_PRODUCT)
    index.train(sample)
    index.nprobe = options.nprobe
    return index


def _first_of_equal(vectors: np.ndarray) -> np.ndarray:
    """Per row, the position of the first row with exactly the same vector."""
    rows = np.ascontiguousarray(vectors, np.float32)
    if not len(rows):
        return np.empty(0, np.int64)
    _, first, inverse = np.unique(rows.view(np.dtype((np.void, rows.shape[1] * 4))).ravel(),
                                  return_index=True, return_inverse=True)
    return first[inverse.ravel()].astype(np.int64)


def index_vectors(vectors: np.ndarray, options: IndexOptions
                  ) -> tuple[faiss.Index, np.ndarray]:
    """A faiss index of ``options.kind`` over ``vectors`` (slots ``0..n-1``) and each
    slot's id in it (``reps``): its own slot, or in an HNSW graph the first slot with the
    same vector (the graph holds each distinct vector once). IVF-PQ is trained on a
    sample of at most 65,536 of them."""
    vectors = np.ascontiguousarray(vectors, np.float32)
    sample = np.random.default_rng(0).permutation(len(vectors))[:1 << 16]
    index = _new_index(vectors.shape[1], options, vectors[np.sort(sample)], len(vectors))
    slots = np.arange(len(vectors), dtype=np.int64)
    reps = _first_of_equal(vectors) if options.kind == "hnsw" else slots
    added = reps == slots
    index.add_with_ids(vectors[added], slots[added])
    return index, reps


def item_index(index: faiss.Index, vectors: np.ndarray, options: IndexOptions,
               reps: np.ndarray | None = None, folder: Path | None = None) -> ItemIndex:
    """An in-memory ``ItemIndex`` over ``vectors`` (slots = positions; ``reps`` as
    ``index_vectors`` gave them), as a loaded generation searches it: for measuring
    settings without writing a folder."""
    n = len(vectors)
    meta = {"kind": options.kind, "dim": int(vectors.shape[1]), "items": n, "next_slot": n,
            "ef_search": options.ef_search, "nprobe": options.nprobe,
            "refine": options.refine, "options": options.__dict__}
    return ItemIndex(folder or Path("."), index, np.arange(n).astype(str),
                     np.zeros((n, 0), np.int64), np.arange(n, dtype=np.int64),
                     np.ascontiguousarray(vectors, np.float32), meta, reps)


class ItemIndex:
    """A loaded generation: search user vectors for their nearest items."""

    def __init__(self, folder: Path, index: faiss.Index, ids: np.ndarray, keys: np.ndarray,
                 slots: np.ndarray, vectors: np.ndarray, meta: dict[str, Any],
                 reps: np.ndarray | None = None) -> None:
        self.folder, self.index, self.ids, self.keys = folder, index, ids, keys
        self.slots, self.vectors, self.meta = slots, vectors, meta
        # each item's id in the index: its slot, or in a graph its vector's first slot
        self.reps = slots if reps is None else reps
        total = int(meta["next_slot"])
        self.slot_item = np.full(total, -1, np.int64)
        self.slot_item[slots] = np.arange(len(slots))
        self._params: Any = None
        if meta["kind"] == "hnsw":
            # the items of each graph id, grouped: _twins[_starts[g]:_starts[g + 1]]
            self._twins = np.argsort(self.reps, kind="stable")
            self._graph_ids, self._starts = np.unique(self.reps[self._twins],
                                                      return_index=True)
            self._starts = np.append(self._starts, len(self.reps))
            # a graph keeps vectors no item has any more: skip them
            held = faiss.vector_to_array(index.id_map)  # type: ignore[attr-defined]
            dead = np.setdiff1d(held, self._graph_ids)
            if len(dead):
                self._selector = faiss.IDSelectorNot(faiss.IDSelectorBatch(dead))
                self._params = faiss.SearchParametersHNSW(  # type: ignore[attr-defined]
                    sel=self._selector, efSearch=meta["ef_search"])

    def records(self, items: np.ndarray) -> list[dict[str, Any]]:
        """The catalog's raw item fields of ``items`` (to score them with a ranker)."""
        if "_catalog" not in self.__dict__:
            table = pq.read_table(self.folder / "catalog.parquet")
            self.__dict__["_catalog"] = {f: np.asarray(table.column(f).to_pylist(), object)
                                         for f in self.meta["fields"]}
        columns = self.__dict__["_catalog"]
        picked = {f: col[items].tolist() for f, col in columns.items()}
        return [dict(zip(picked, row, strict=True)) for row in zip(*picked.values(),
                                                                     strict=True)]

    @property
    def dim(self) -> int:
        return int(self.meta["dim"])

    def __len__(self) -> int:
        return len(self.ids)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(item positions, scores), ``[q, k]`` each, best first; -1 past the last hit."""
        queries = np.ascontiguousarray(queries, np.float32)
        k = min(k, len(self))
        if self.meta["kind"] == "ivfpq":
            wanted = k * int(self.meta.get("refine", 1))
            _, slots = self.index.search(queries, wanted, params=self._probes(wanted))
            return self._refined(queries, slots, k)
        if self._params is not None:
            scores, found = self.index.search(queries, k, params=self._params)
        else:
            scores, found = self.index.search(queries, k)
        return self._with_twins(found, scores, k)

    def _probes(self, wanted: int) -> Any:
        """Search parameters probing ``nprobe`` lists, or as many as hold ``wanted``
        candidates on average: a large k on a small catalog would otherwise come back
        short of what the catalog holds."""
        ivf = faiss.extract_index_ivf(self.index)
        per_list = max(1.0, ivf.ntotal / max(1, ivf.nlist))
        probes = min(ivf.nlist, max(int(ivf.nprobe), math.ceil(wanted / per_list)))
        return faiss.SearchParametersIVF(nprobe=probes)  # type: ignore[call-arg]

    def _with_twins(self, found: np.ndarray, scores: np.ndarray, k: int
                    ) -> tuple[np.ndarray, np.ndarray]:
        """The items of the graph ids ``found`` (best first), each distinct vector's
        items together with its score, the first ``k`` per query: every query's groups
        cut to what fills its ``k`` places, then gathered in one pass."""
        hit = found >= 0
        group = np.searchsorted(self._graph_ids, np.where(hit, found, self._graph_ids[0]))
        lo = self._starts[group]
        sizes = np.where(hit, self._starts[group + 1] - lo, 0)
        before = np.cumsum(sizes, axis=1) - sizes  # places taken by the better groups
        counts = np.minimum(sizes, np.maximum(k - before, 0)).ravel()
        n = int(counts.sum())
        per_query = counts.reshape(found.shape).sum(axis=1)
        rows = np.repeat(np.arange(len(found)), per_query)
        place = np.arange(n) - np.repeat(np.cumsum(per_query) - per_query, per_query)
        within = np.arange(n) - np.repeat(np.cumsum(counts) - counts, counts)
        items = np.full(found.shape, -1, np.int64)
        out = np.full(found.shape, -np.inf, np.float32)
        items[rows, place] = self._twins[np.repeat(lo.ravel(), counts) + within]
        out[rows, place] = np.repeat(scores.ravel(), counts)
        return items, out

    def _refined(self, queries: np.ndarray, slots: np.ndarray, k: int
                 ) -> tuple[np.ndarray, np.ndarray]:
        """Product-quantised candidates re-scored with the exact vectors: PQ distances
        rank the neighbourhood roughly, the top ``k`` of it needs the real ones."""
        items = np.where(slots >= 0, self.slot_item[np.maximum(slots, 0)], -1)
        exact = np.einsum("qcd,qd->qc", self.vectors[np.maximum(items, 0)], queries)
        exact = np.where(items >= 0, exact, -np.inf).astype(np.float32)
        order = np.argsort(-exact, axis=1, kind="stable")[:, :k]
        best = np.take_along_axis(items, order, 1)
        scores = np.take_along_axis(exact, order, 1)
        return np.where(np.isfinite(scores), best, -1), scores

    def exact(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Brute-force top ``k`` by inner product over the same vectors (the baseline)."""
        flat = faiss.IndexFlatIP(self.dim)
        flat.add(self.vectors)
        scores, items = flat.search(np.ascontiguousarray(queries, np.float32), min(k, len(self)))
        return items, scores


def current_generation(out: str | Path) -> Path | None:
    out = Path(out)
    try:
        name = (out / CURRENT).read_text().strip()
    except OSError:
        return None
    return out / name if (out / name / "meta.json").is_file() else None


def load_index(out: str | Path) -> ItemIndex:
    """The current generation of index folder ``out``."""
    folder = current_generation(out)
    if folder is None:
        raise IndexFolderError(f"{out}: no index (no {CURRENT} naming a complete generation); "
                          "build one with `terarec index`")
    try:
        meta = json.loads((folder / "meta.json").read_text())
        index = faiss.read_index(str(folder / "index.faiss"))
        with np.load(folder / "items.npz") as items:
            ids, keys, slots = items["ids"], items["keys"], items["slots"]
            reps = items.get("reps")  # None: a folder written before twins
        vectors = np.load(folder / "vectors.npy", mmap_mode="r")
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise IndexFolderError(f"{folder}: unreadable index ({exc})") from None
    if meta["kind"] == "hnsw":
        base: Any = faiss.downcast_index(index.index)  # type: ignore[attr-defined]
        base.hnsw.efSearch = meta["ef_search"]
    elif meta["kind"] == "ivfpq":
        faiss.extract_index_ivf(index).nprobe = meta["nprobe"]
    return ItemIndex(folder, index, ids, keys, slots, np.asarray(vectors), meta, reps)


class IndexWatcher:
    """The generations of an index folder a server searches, following ``CURRENT``.

    ``refresh`` (run by the engine's version poller, serving/retrieve.py) loads a
    generation ``CURRENT`` newly names; the last ``keep`` loaded stay in memory. Each
    request takes one generation (``for_version``): the newest built from the served
    version (the item tower exported with the user tower being served), else the newest.
    So a new generation is searched once the model version whose item tower built it is
    served, and a request never sees a half-swapped index: the list is replaced whole.
    """

    def __init__(self, out: str | Path | None, first: ItemIndex | None = None,
                 keep: int = 2) -> None:
        self.out = None if out is None else Path(out)
        self.keep = max(1, keep)
        if first is None:
            if self.out is None:
                raise ValueError("IndexWatcher needs an index folder or a loaded index")
            first = load_index(self.out)
        self._loaded: tuple[ItemIndex, ...] = (first,)
        self._failed: str | None = None
        self._lock = threading.Lock()

    @classmethod
    def fixed(cls, index: ItemIndex) -> IndexWatcher:
        """One loaded index, never swapped."""
        return cls(None, index)

    @property
    def newest(self) -> ItemIndex:
        return self._loaded[-1]

    def for_version(self, version_name: str | None) -> ItemIndex:
        """The generation to search for a request served by ``version_name``."""
        loaded = self._loaded
        for index in reversed(loaded):
            if index.meta.get("version") == version_name:
                return index
        return loaded[-1]

    def refresh(self) -> bool:
        """Load the generation ``CURRENT`` names if it is new; whether one was loaded.
        A generation that fails to load is logged once and the served ones kept."""
        if self.out is None:
            return False
        with self._lock:
            folder = current_generation(self.out)
            if folder is None or folder.name in (self.newest.folder.name, self._failed):
                return False
            try:
                index = load_index(self.out)
            except IndexFolderError as exc:
                self._failed = folder.name
                log.warning("%s; still searching %s", exc, self.newest.folder.name)
                return False
            self._loaded = (*self._loaded, index)[-self.keep:]
            log.info("item index %s loaded (%d items, built from %s)", index.folder.name,
                     len(index), index.meta.get("version"))
            return True


def _catalog_blocks(path: Path, version: ServedVersion, fields: tuple[str, ...],
                    rows: int) -> Iterator[dict[str, pa.Array]]:
    yield from iter_field_columns(path, version.raw_schema or version.schema, fields, rows)


def _open_engine(uri: str, storage_options: dict[str, Any] | None,
                 cache_dir: Path) -> tuple[ServingEngine, ServedVersion]:
    engine = ServingEngine(uri, storage_options=storage_options, cache_dir=cache_dir,
                           cache_rows=1, incomplete_timeout_s=0.0)
    engine.refresh()
    if engine.current is None:
        reasons = "; ".join(f"{k}: {v}" for k, v in engine.refused.items())
        raise IndexFolderError(f"{uri}: no loadable version" + (f" ({reasons})" if reasons else ""))
    return engine, engine.current


def _file_digest(path: Path) -> str:
    from terarec.io import sha256_file

    return sha256_file(path)


def build_index(uri: str, catalog: str | Path, out: str | Path,
                options: IndexOptions | None = None, *, id_field: str | None = None,
                storage_options: dict[str, Any] | None = None,
                rows: int = EMBED_ROWS) -> dict[str, Any]:
    """Embed every catalog item with ``uri``'s newest version and index the vectors."""
    options = options or IndexOptions()
    catalog = Path(catalog)
    with tempfile.TemporaryDirectory(prefix="terarec-index-") as tmp:
        engine, version = _open_engine(uri, storage_options, Path(tmp))
        try:
            t0 = time.perf_counter()
            model = _tower(version)
            fields = tuple(model.item_fields)
            id_field = id_field or fields[0]
            if id_field not in fields:
                raise ValueError(f"--id-field {id_field!r} is not an item field "
                                 f"{list(fields)}")
            vec_parts, key_parts, raw_parts = [], [], []
            for block in _catalog_blocks(catalog, version, fields, rows):
                vec_parts.append(embed_items(engine, version, block))
                key_parts.append(np.stack([hash_column(f, block[f], version.schema.hash_salt)
                                           for f in fields], axis=1))
                raw_parts.append(pa.table(block))
            if not vec_parts:
                raise ValueError(f"{catalog}: no items")
            vectors = np.concatenate(vec_parts)
            embed_s = time.perf_counter() - t0
            raw = pa.concat_tables(raw_parts).combine_chunks()
            keys = np.concatenate(key_parts)
            ids = np.asarray(raw.column(id_field).to_numpy(zero_copy_only=False), dtype=str)
            _check_unique_ids(ids, catalog, id_field)
            t1 = time.perf_counter()
            index, reps = index_vectors(vectors, options)
            slots = np.arange(len(vectors), dtype=np.int64)
            build_s = time.perf_counter() - t1
            meta = {"uri": str(uri), "version": version.name,
                    "created": version.manifest.created, "chain": version.manifest.chain,
                    "dense_sha256": dense_digest(version), "kind": options.kind,
                    "dim": int(vectors.shape[1]), "items": len(vectors),
                    "next_slot": len(vectors), "fields": list(fields), "id_field": id_field,
                    "catalog_sha256": _file_digest(catalog), "ef_search": options.ef_search,
                    "nprobe": options.nprobe, "refine": options.refine,
                    "options": options.__dict__}
            name = _write_generation(Path(out), index, ids, keys, slots, reps, vectors,
                                     raw, meta)
        finally:
            engine.close()
    return {"out": str(out), "generation": name, "mode": "full", "version": meta["version"],
            "items": len(vectors), "embedded": len(vectors), "embed_s": embed_s,
            "build_s": build_s, "kind": options.kind}


def _check_unique_ids(ids: np.ndarray, catalog: Path, id_field: str) -> None:
    """Refuse a catalog holding an item id twice: every copy was indexed, and /retrieve
    answered the same item again and again instead of ``top_k`` items."""
    order = np.argsort(ids, kind="stable")
    repeats = np.flatnonzero(ids[order][1:] == ids[order][:-1])
    if not len(repeats):
        return
    j = int(np.argmin(order[repeats + 1]))  # the first repeat in file order
    first, again = int(order[repeats[j]]), int(order[repeats[j] + 1])
    # lines of a text catalog count its header; a Parquet file has rows
    unit, base = ("rows", 1) if catalog.suffix == ".parquet" else ("lines", 2)
    raise ValueError(f"{catalog}: item {str(ids[again])!r} (id field {id_field!r}) is on "
                     f"{unit} {first + base} and {again + base}; a catalog lists each item "
                     "once")


def update_index(uri: str, catalog: str | Path, out: str | Path,
                 options: IndexOptions | None = None, *, id_field: str | None = None,
                 storage_options: dict[str, Any] | None = None,
                 rows: int = EMBED_ROWS) -> dict[str, Any]:
    """Bring index folder ``out`` up to ``uri``'s newest version: re-embed only the items
    whose rows changed when that is enough (module docstring), else rebuild."""
    folder = current_generation(out)
    if folder is None:
        return build_index(uri, catalog, out, options, id_field=id_field,
                           storage_options=storage_options, rows=rows)
    old = load_index(out)
    meta = old.meta
    options = options or IndexOptions(**meta["options"])
    with tempfile.TemporaryDirectory(prefix="terarec-index-") as tmp:
        engine, version = _open_engine(uri, storage_options, Path(tmp))
        try:
            chain = version.manifest.chain
            same = (meta["uri"] == str(uri) and chain[:len(meta["chain"])] == meta["chain"]
                    and meta["catalog_sha256"] == _file_digest(Path(catalog))
                    and options == IndexOptions(**meta["options"])
                    and dense_digest(version) == meta["dense_sha256"])
            if same and version.name == meta["version"]:
                return {"out": str(out), "generation": folder.name, "mode": "current",
                        "version": version.name, "items": len(old), "embedded": 0,
                        "embed_s": 0.0, "build_s": 0.0, "kind": meta["kind"]}
            if not same:
                engine.close()
                return build_index(uri, catalog, out, options, id_field=id_field,
                                   storage_options=storage_options, rows=rows)
            t0 = time.perf_counter()
            changed = _changed_keys(engine, chain[len(meta["chain"]):])
            stale = np.flatnonzero(np.isin(old.keys, changed).any(axis=1))
            raw = pq.read_table(folder / "catalog.parquet")
            vectors = np.array(old.vectors)
            fields = tuple(meta["fields"])
            for lo in range(0, len(stale), rows):
                part = raw.take(pa.array(stale[lo:lo + rows]))
                vectors[stale[lo:lo + rows]] = embed_items(
                    engine, version, {f: part.column(f).combine_chunks() for f in fields})
            embed_s = time.perf_counter() - t0
            t1 = time.perf_counter()
            index = old.index
            slots = old.slots.copy()
            first = int(meta["next_slot"])
            new_slots = np.arange(first, first + len(stale), dtype=np.int64)
            if meta["kind"] == "ivfpq" and len(stale):
                index.remove_ids(faiss.IDSelectorBatch(slots[stale]))
            reps = _updated_reps(old, vectors, stale, new_slots)
            added = reps[stale] == new_slots  # vectors the index does not hold yet
            if added.any():
                index.add_with_ids(vectors[stale[added]], new_slots[added])
            slots[stale] = new_slots
            build_s = time.perf_counter() - t1
            meta = {**meta, "version": version.name, "created": version.manifest.created,
                    "chain": chain, "next_slot": first + len(stale)}
            name = _write_generation(Path(out), index, old.ids, old.keys, slots, reps,
                                     vectors, raw, meta)
        finally:
            engine.close()
    return {"out": str(out), "generation": name, "mode": "delta", "version": version.name,
            "items": len(vectors), "embedded": int(len(stale)), "embed_s": embed_s,
            "build_s": build_s, "kind": meta["kind"]}


def _updated_reps(old: ItemIndex, vectors: np.ndarray, stale: np.ndarray,
                  new_slots: np.ndarray) -> np.ndarray:
    """The items' index ids after the ``stale`` items got ``vectors[stale]`` and slots
    ``new_slots``: in a graph, a vector an item still in it has keeps that item's id, a
    vector new to the graph its first new slot; elsewhere the new slots."""
    reps = old.reps.copy()
    if old.meta["kind"] != "hnsw":
        reps[stale] = new_slots
        return reps
    kept = np.ones(len(reps), np.bool_)
    kept[stale] = False
    live, at = np.unique(reps[kept], return_index=True)  # graph ids items still have
    known = vectors[np.flatnonzero(kept)[at]]
    first = _first_of_equal(np.concatenate([known, vectors[stale]]))[len(known):]
    twin = first < len(known)
    reps[stale[twin]] = live[first[twin]]
    reps[stale[~twin]] = new_slots[first[~twin] - len(known)]
    return reps


def _changed_keys(engine: ServingEngine, deltas: list[str]) -> np.ndarray:
    parts = [np.empty(0, np.int64)]
    for name in deltas:
        manifest: Manifest = engine.reader.manifest(name)
        upserts, _, deleted = engine.reader.delta(manifest)
        parts += [upserts, deleted]
    return np.unique(np.concatenate(parts))


def _write_generation(out: Path, index: faiss.Index, ids: np.ndarray, keys: np.ndarray,
                      slots: np.ndarray, reps: np.ndarray, vectors: np.ndarray,
                      raw: pa.Table, meta: dict[str, Any]) -> str:
    """Write a new generation folder whole, then point ``CURRENT`` at it; older
    generations but the previous one (a server may still be reading it) are removed."""
    import shutil

    out.mkdir(parents=True, exist_ok=True)
    numbers = [int(p.name[1:]) for p in out.glob("g[0-9]*") if p.name[1:].isdigit()]
    name = f"g{max(numbers, default=0) + 1:06d}"
    folder = out / name
    folder.mkdir()
    with atomic_path(folder / "index.faiss") as tmp:
        faiss.write_index(index, str(tmp))
    with atomic_path(folder / "items.npz") as tmp, open(tmp, "wb") as fh:
        np.savez(fh, ids=ids, keys=keys, slots=slots, reps=reps)
    with atomic_path(folder / "vectors.npy") as tmp, open(tmp, "wb") as fh:
        np.save(fh, np.ascontiguousarray(vectors, np.float32))
    with atomic_path(folder / "catalog.parquet") as tmp:
        pq.write_table(raw, tmp)
    atomic_write_text(folder / "meta.json", json.dumps(meta, indent=2))
    previous = current_generation(out)
    atomic_write_text(out / CURRENT, name)
    for p in out.glob("g[0-9]*"):
        if p.name not in (name, previous.name if previous else None):
            shutil.rmtree(p, ignore_errors=True)
    return name
