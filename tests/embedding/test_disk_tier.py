"""The slab-file disk tier: round trips, growth across slabs, slot reuse, snapshots, and
the RAM bound of a tiered store several times larger than its budget."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from terarec.embedding.disk import DiskTier, read_snapshot_records
from terarec.embedding.tiered import _MMAP_THRESHOLD_BYTES

SRC = Path(__file__).resolve().parents[2] / "src"
WIDTH = 7


def _records(keys: np.ndarray, salt: float = 0.0) -> np.ndarray:
    rec = (keys[:, None] % 1000).astype(np.float32) + np.arange(WIDTH, dtype=np.float32) + salt
    rec[:, -1] = (keys % 50).astype(np.int32).view(np.float32)  # last_seen bits
    return rec


def test_round_trip_grows_across_slabs(tmp_path):
    disk = DiskTier(tmp_path, WIDTH, slab_bytes=4096)  # 1024 rows per slab
    keys = np.random.default_rng(0).permutation(np.arange(-5000, 5000, dtype=np.int64) * 31)
    for start in range(0, len(keys), 3000):  # the table grows over several writes
        part = keys[start:start + 3000]
        disk.write(part, _records(part))
    assert len(disk) == len(keys)
    assert len(disk._maps) == -(-len(keys) // disk.slab_rows) >= 10
    rec, found = disk.read(np.concatenate([keys[::7], [123456789]]))
    assert found[:-1].all() and not found[-1]
    np.testing.assert_array_equal(rec[:-1], _records(keys[::7]))
    np.testing.assert_array_equal(rec[-1], 0)
    ks, slots = disk.items()
    np.testing.assert_array_equal(disk.last_seen[slots], ks % 50)


def test_overwrite_and_slot_reuse_after_remove(tmp_path):
    disk = DiskTier(tmp_path, WIDTH, slab_bytes=4096)
    keys = np.arange(1, 3001, dtype=np.int64)
    disk.write(keys, _records(keys))
    disk.write(keys[:100], _records(keys[:100], salt=0.5))
    gone = keys[100:600]
    assert disk.remove(np.concatenate([gone, [10**9]])).tolist() == [True] * 500 + [False]
    assert not disk.contains(gone).any()
    bound = disk.index.slot_bound
    newcomers = np.arange(10_001, 10_401, dtype=np.int64)
    disk.write(newcomers, _records(newcomers, salt=2.0))
    assert disk.index.slot_bound == bound  # freed slots were taken, the files did not grow
    rec, found = disk.read(np.concatenate([keys[:100], keys[600:], newcomers, gone]))
    np.testing.assert_array_equal(found, [True] * 2900 + [False] * 500)
    np.testing.assert_array_equal(rec[:100], _records(keys[:100], salt=0.5))
    np.testing.assert_array_equal(rec[100:2500], _records(keys[600:]))
    np.testing.assert_array_equal(rec[2500:2900], _records(newcomers, salt=2.0))


def test_snapshot_restore_and_stale_files_cleared(tmp_path):
    disk = DiskTier(tmp_path / "live", WIDTH, slab_bytes=4096)
    keys = np.arange(1, 2501, dtype=np.int64) * 7
    disk.write(keys, _records(keys))
    disk.remove(keys[:10])
    digests = disk.snapshot(tmp_path / "snap", None, {})
    assert set(digests) == {f"slab-{i:06d}.bin" for i in range(3)} | {"index.safetensors"}
    disk.write(keys[10:20], _records(keys[10:20], salt=9.0))  # after the snapshot
    with pytest.raises(RuntimeError, match="in use by another process"):
        DiskTier(tmp_path / "live", WIDTH)
    disk.release()
    # A new tier on the same folder starts empty: leftovers of a killed run are not data.
    fresh = DiskTier(tmp_path / "live", WIDTH, slab_bytes=4096)
    assert len(fresh) == 0 and not list((tmp_path / "live").glob("slab-*"))
    fresh.restore(tmp_path / "snap")
    rec, found = fresh.read(keys)
    assert not found[:10].any() and found[10:].all()
    np.testing.assert_array_equal(rec[10:], _records(keys[10:]))
    streamed = list(read_snapshot_records(tmp_path / "snap", chunk=1000))
    got_keys = np.concatenate([k for k, _ in streamed])
    got_rec = np.concatenate([r for _, r in streamed])
    order = np.argsort(got_keys)
    np.testing.assert_array_equal(got_keys[order], keys[10:])
    np.testing.assert_array_equal(got_rec[order], _records(keys[10:]))


_RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import numpy as np
    from terarec.config import SparseOptimizerConfig, StoreConfig
    from terarec.embedding.optimizers import SparseOptimizer
    from terarec.embedding.types import RowBlock
    from terarec.embedding.tiered import TieredStore

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    budget, path = sys.argv[1], sys.argv[2]
    opt = SparseOptimizer(SparseOptimizerConfig(name="adam"))
    store = TieredStore(96, opt, StoreConfig(memory_budget=budget), path=path)
    rng = np.random.default_rng(0)
    def one_pass(keys, pass_id):
        ones = np.ones(len(keys), np.float32)
        block, admitted = store.pull(keys, ones, ones, pass_id)
        store.prefetch(keys[::-1])
        store.push(keys[admitted], RowBlock(block.values + 1, block.state))
        store.end_pass(pass_id)
    # Warm up on a throwaway store whose rows overflow its budget, so that every code
    # path (spill, disk read and write, compaction) is compiled before the baseline.
    real, store = store, TieredStore(96, opt, StoreConfig(memory_budget="2MB"),
                                     path=path + "-warmup")
    for p in range(4):
        one_pass(np.arange(p * 700, p * 700 + 1400, dtype=np.int64), p)
    store.evict(np.arange(10**4, dtype=np.int64))
    store.close()
    store = real
    baseline = status("VmRSS")
    for p in range(1, 61):
        fresh = np.arange(p * 3000, (p + 1) * 3000, dtype=np.int64)
        old = rng.integers(3000, p * 3000 + 1, 1000)
        one_pass(np.unique(np.concatenate([fresh, old])), p)
    print(json.dumps({"baseline": baseline, "peak": status("VmHWM"), "keys": len(store),
                      "record_bytes": 4 * store.width,
                      "memory_keys": store.tier_stats().memory_keys}))
""")


def test_peak_rss_stays_within_budget_for_a_table_four_times_larger(tmp_path):
    budget = 28 << 20
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get(
        "PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, str(budget), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import json
    out = json.loads(done.stdout.strip().splitlines()[-1])
    table = out["keys"] * out["record_bytes"]
    assert table > 4 * budget
    # Over the start: the budget plus buffers of one pass (4k rows pulled, initialised,
    # read from disk, assembled, pushed, and slab pages mapped meanwhile), which depend on
    # the pass size, not on the table's (measured: 9-10 copies of the pass's rows).
    pass_overhead = 12 * 4000 * out["record_bytes"]
    assert budget + pass_overhead < table / 2
    # glibc keeps freed buffers below its mmap threshold, and up to its trim threshold at
    # the heap top, for reuse: a fixed allowance, whatever the table's size.
    allocator_slack = 2 * _MMAP_THRESHOLD_BYTES
    assert out["peak"] - out["baseline"] < budget + pass_overhead + allocator_slack, out
    assert 0 < out["memory_keys"] < out["keys"] / 4


@pytest.fixture
def full_disk(tmp_path):
    """A 1 MB filesystem of its own (tmpfs: mounting needs root, else the test skips)."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=True)


@pytest.mark.parametrize("key_index", ["ram", "disk"])
def test_full_disk_is_an_error_naming_the_folder_not_sigbus(full_disk, key_index):
    """Slabs are sparse files written through mappings: on a full disk a write to a hole
    was a SIGBUS that killed the process without a word."""
    script = textwrap.dedent(f"""
        import numpy as np
        from terarec.embedding.disk import DiskTier
        from terarec.io import NotWritableError
        tier = DiskTier({str(full_disk / "store")!r}, 20, key_index={key_index!r},
                        buffer_keys=1024)
        try:
            for start in range(0, 1_000_000, 10_000):
                keys = np.arange(start, start + 10_000, dtype=np.int64) + 1
                tier.write(keys, np.ones((len(keys), 20), np.float32))
                tier.end_pass()
        except NotWritableError as exc:
            print("REFUSED", exc.strerror)
    """)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "REFUSED cannot write" in done.stdout and "no space left" in done.stdout


def test_prefetch_asks_for_exactly_the_pages_of_the_records():
    """The read-ahead covers every page a record lies on and no other, adjacent pages in
    one run (one system call each)."""
    from terarec.embedding.disk import _page_runs

    rng = np.random.default_rng(3)
    page, width, shift = 4096, 133, 10  # 532-byte records, 1,024 per slab
    mask = (1 << shift) - 1
    bases = np.array([5 << 30, 1 << 32, 1 << 30], np.int64)  # maps fall in address
    slots = rng.choice(3 << shift, 400, replace=False).astype(np.int64)
    slots[::7] = -1
    order = np.argsort(slots, kind="stable")
    starts, lengths = np.empty(len(slots), np.int64), np.empty(len(slots), np.int64)
    n = _page_runs(bases, slots, order, shift, mask, 4 * width, page, starts, lengths)
    wanted = set()
    for s in slots[slots >= 0].tolist():
        address = int(bases[s >> shift]) + (s & mask) * 4 * width
        wanted.update(range(address // page, (address + 4 * width - 1) // page + 1))
    got = [p for a, b in zip(starts[:n], lengths[:n], strict=True)
           for p in range(a // page, (a + b) // page)]
    assert sorted(got) == sorted(wanted) and len(got) == len(set(got))
    runs = sorted(zip(starts[:n].tolist(), lengths[:n].tolist(), strict=True))
    assert all(a + b < c for (a, b), (c, _) in zip(runs, runs[1:], strict=False))  # merged


def test_reads_through_the_prefetch_return_the_written_records(tmp_path):
    tier = DiskTier(tmp_path, width=133, slab_bytes=133 * 4 * 1024, mapped_bytes=1 << 16)
    keys = np.arange(5000, dtype=np.int64) * 7919
    records = np.random.default_rng(0).standard_normal((5000, 133)).astype(np.float32)
    tier.write(keys, records)
    pick = np.random.default_rng(1).permutation(5000)[:3000]
    got, found = tier.read(np.concatenate([keys[pick], [-1, 12345678]]))
    np.testing.assert_array_equal(got[:3000], records[pick])
    assert found[:3000].all() and not found[3000:].any()
