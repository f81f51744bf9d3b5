"""Each rank's share of a file (``terarec.data.split``) is exactly its round-robin share of
the batches the whole-file reader cuts, with the same checks and line numbers."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from terarec.data import split
from terarec.data.readers import DataError, ReadStats, csv_schema, iter_tables, parquet_schema
from terarec.data.split import iter_rank_tables, iter_tables_from, line_index
from terarec.data.synth import generate
from terarec.types import FeatureSchema

CSV = csv_schema("label", ["x"], ["a", "tags"], multi_valued=["tags"], separator="|")


def _csv_lines(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    lines = ["label,x,a,tags"]
    for i in range(n):
        tags = "|".join(f"t{t}" for t in rng.integers(0, 9, rng.integers(0, 4)))
        x = "" if i % 7 == 0 else f"{rng.normal():.3f}"
        lines.append(f"{int(rng.random() < 0.3)},{x},a{rng.integers(40)},{tags}")
    return lines


def _criteo_lines(n: int) -> list[str]:
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        ints = ["" if (i + j) % 5 == 0 else str(int(v)) for j, v in
                enumerate(rng.integers(0, 300, 13))]
        cats = [f"{int(v):08x}" for v in rng.integers(0, 50, 26)]
        out.append("\t".join([str(i % 2), *ints, *cats]))
    return out


def _rank_share(path: Path, schema: FeatureSchema, local: int, world: int,
                **kw) -> list[list[tuple[pa.Table | None, int]]]:
    return [list(iter_rank_tables(path, schema, local, r, world, **kw)) for r in range(world)]


def _assert_deal_matches_whole_file(path: Path, schema: FeatureSchema, local: int,
                                    world: int) -> None:
    whole = list(iter_tables(path, schema, local))
    shares = _rank_share(path, schema, local, world)
    steps = -(-len(whole) // world)
    for r in range(world):
        assert len(shares[r]) == steps
    for k, table in enumerate(whole):
        got, step_rows = shares[k % world][k // world]
        assert got is not None and got.equals(table), f"local batch {k}"
        assert step_rows == sum(t.num_rows for t in whole[k - k % world:][:world])
    for r in range(world):  # ranks past the file's last local batch get nothing
        assert all(t is None for t, _ in shares[r][len(whole[r::world]):])


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("newline", ["\n", "\r\n"])
@pytest.mark.parametrize("trailing", [True, False])
def test_csv_share_is_the_round_robin_deal_of_the_whole_file(tmp_path, world, newline,
                                                             trailing):
    text = newline.join(_csv_lines(203)) + (newline if trailing else "")
    path = tmp_path / "rows.csv"
    path.write_bytes(text.encode())
    assert line_index(path, 16, header_lines=1, quoted=True) is not None
    _assert_deal_matches_whole_file(path, CSV, 16, world)


def test_criteo_share_spans_many_scan_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(split, "_SCAN_BYTES", 1000)  # newlines found chunk by chunk
    path = tmp_path / "day.txt"
    path.write_text("\n".join(_criteo_lines(130)) + "\n")
    for world in (1, 2, 4):
        _assert_deal_matches_whole_file(path, FeatureSchema.criteo(), 12, world)


def test_line_index_offsets_are_line_starts(tmp_path, monkeypatch):
    monkeypatch.setattr(split, "_SCAN_BYTES", 37)
    lines = _csv_lines(50)
    path = tmp_path / "rows.csv"
    path.write_text("\n".join(lines) + "\n")
    starts = np.cumsum([0] + [len(line) + 1 for line in lines])  # byte offset of each line
    for stride in (1, 3, 50, 60):
        index = line_index(path, stride, header_lines=1)
        assert index is not None and index.lines == 50
        assert index.starts.tolist() == [*starts[1:-1][::stride], starts[-1]]
    no_header = line_index(path, 7)
    assert no_header is not None and no_header.lines == 51
    assert no_header.starts.tolist() == [*starts[:-1][::7], starts[-1]]


def test_files_not_cut_by_newlines_are_read_whole_by_every_rank(tmp_path):
    lines = _csv_lines(60)
    bare_cr = tmp_path / "cr.csv"
    bare_cr.write_bytes("\r".join(lines).encode())
    quoted = tmp_path / "quoted.csv"
    quoted.write_text("\n".join([*lines[:10], '1,0.5,"a\nb",t1', *lines[10:]]) + "\n")
    packed = tmp_path / "rows.csv.gz"
    packed.write_bytes(gzip.compress(("\n".join(lines[1:]) + "\n").encode()))
    with_header = tmp_path / "header.csv.gz"  # the header is read decompressed
    with_header.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    assert list(iter_tables(with_header, CSV, 8))[0].equals(
        list(iter_tables(quoted, CSV, 8))[0])
    assert line_index(bare_cr, 8, header_lines=1) is None
    assert line_index(quoted, 8, header_lines=1, quoted=True) is None
    # pyarrow decompresses by extension; the header is read from the plain text file
    schema = csv_schema("label", ["x"], ["a", "tags"], multi_valued=["tags"], separator="|",
                        has_header=False, column_names=["label", "x", "a", "tags"])
    plain = tmp_path / "rows.csv"
    plain.write_text("\n".join(lines[1:]) + "\n")
    for world in (1, 2):
        _assert_deal_matches_whole_file(bare_cr, CSV, 8, world)
        _assert_deal_matches_whole_file(quoted, CSV, 8, world)
        _assert_deal_matches_whole_file(packed.with_name("rows.csv"), schema, 8, world)
        _assert_deal_matches_whole_file(with_header, CSV, 8, world)
        shares = _rank_share(packed, schema, 8, world)
        whole = list(iter_tables(plain, schema, 8))
        got = [t for k in range(len(whole)) for t in [shares[k % world][k // world][0]]]
        assert all(g.equals(w) for g, w in zip(got, whole, strict=True))


@pytest.mark.parametrize("world", [1, 2, 3])
def test_parquet_share_reads_row_ranges_across_row_groups(tmp_path, world):
    rng = np.random.default_rng(2)
    n = 230
    table = pa.table({
        "label": rng.integers(0, 2, n), "x": rng.normal(size=n),
        "a": [f"a{v}" for v in rng.integers(0, 30, n)],
        "tags": [[f"t{t}" for t in rng.integers(0, 9, rng.integers(0, 3))] for _ in range(n)]})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=37)  # batches of 16 straddle row groups
    schema = parquet_schema("label", ["x"], ["a", "tags"], multi_valued=["tags"])
    _assert_deal_matches_whole_file(path, schema, 16, world)


def _with_bad_rows(tmp_path: Path) -> Path:
    lines = _csv_lines(100)
    lines[40] = lines[40].split(",", 1)[0] + ",abc," + lines[40].split(",", 2)[2]  # x
    lines[57] = "2" + lines[57][1:]  # label
    lines[90] = "1,0.5"  # too few columns
    path = tmp_path / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_bad_row_is_found_by_the_rank_that_reads_it_with_its_line(tmp_path):
    path = _with_bad_rows(tmp_path)
    # line 41 of the file (1-based, the header is line 1) is data line 39: local batch 2
    # (16 rows each), which rank 0 of 2 reads; rank 1 reads past it untouched.
    with pytest.raises(DataError, match=r"bad\.csv: line 41: field 'x': not a finite "
                                        r"number, got 'abc'"):
        list(iter_rank_tables(path, CSV, 16, 0, 2))
    with pytest.raises(DataError, match=r"line 58: field 'label': label must be 0 or 1"):
        list(iter_rank_tables(path, CSV, 16, 1, 2))
    # the whole-file reader names the earliest bad row: pyarrow drops the short line 91
    # while parsing the block, and the values before it are checked first (it reported
    # line 91, parsed before any value was checked)
    with pytest.raises(DataError, match=r"bad\.csv: line 41: field 'x': not a finite "
                                        r"number, got 'abc'"):
        list(iter_tables(path, CSV, 16))
    lines = path.read_text().splitlines(keepends=True)
    short_first = tmp_path / "short.csv"
    short_first.write_text("".join(lines[:40]) + "".join(lines[90:91]) + "".join(lines[40:]))
    with pytest.raises(DataError, match=r"short\.csv: line 41: field 'a': 2 columns, "
                                        r"expected 4"):
        list(iter_tables(short_first, CSV, 16))


def test_skipped_rows_summed_over_ranks_are_the_single_process_ones(tmp_path):
    path = _with_bad_rows(tmp_path)
    single = ReadStats()
    whole_rows = sum(t.num_rows for t in iter_tables(path, CSV, 16, on_bad_row="skip",
                                                     stats=single))
    assert single.skipped == 3
    for world in (2, 3):
        stats = [ReadStats() for _ in range(world)]
        shares = [list(iter_rank_tables(path, CSV, 16, r, world, on_bad_row="skip",
                                        stats=stats[r])) for r in range(world)]
        assert sum(s.skipped for s in stats) == 3
        assert sum(s.rows for s in stats) == whole_rows
        assert sorted(m for s in stats for m in s.examples) == sorted(single.examples)
        rows = sum(t.num_rows for share in shares for t, _ in share if t is not None)
        assert rows == whole_rows == 97
        # steps count lines, so every rank cuts passes at the same places
        assert {tuple(n for _, n in share) for share in shares} == {
            tuple([16 * world] * (100 // (16 * world)) + [100 % (16 * world)] * bool(
                100 % (16 * world)))}


def test_file_level_errors_on_every_rank(tmp_path):
    header_only = tmp_path / "header.csv"
    header_only.write_text("label,x,a,tags\n")
    for rank in (0, 1):
        with pytest.raises(DataError, match="no data rows"):
            list(iter_rank_tables(header_only, CSV, 8, rank, 2))
        with pytest.raises(DataError, match="file not found"):
            list(iter_rank_tables(tmp_path / "nope.csv", CSV, 8, rank, 2))
    missing = tmp_path / "cols.csv"
    missing.write_text("label,x,a\n1,2,a\n")
    with pytest.raises(DataError,
                       match=r"line 1: field\(s\) \['tags' \(categorical\)\] are not among"):
        list(iter_rank_tables(missing, CSV, 8, 1, 2))


def test_files_with_no_rows_read_as_zero_rows_where_allowed(tmp_path):
    """``InputFile.empty_ok`` (a followed source's files): a zero-byte file, a header-only
    CSV, a gzip of nothing and a Parquet file of no rows give no steps on one process and
    on a rank; the same files named as inputs are refused."""
    from terarec.data.positions import InputFile, Positions
    from terarec.data.readers import no_data_rows
    from terarec.distributed.sharding import iter_rank_pass_inputs
    from terarec.train.passes import iter_input_passes

    csv = csv_schema("y", ["n"], ["c"])
    header_only = tmp_path / "h.csv"
    header_only.write_text("y,n,c\n\n")
    zero = tmp_path / "z.csv"
    zero.write_bytes(b"")
    gz = tmp_path / "g.csv.gz"
    gz.write_bytes(gzip.compress(b"y,n,c\n"))
    table = pa.table({"y": pa.array([], pa.int64()), "n": pa.array([], pa.float64()),
                      "c": pa.array([], pa.string())})
    parquet = tmp_path / "e.parquet"
    pq.write_table(table, parquet)
    pschema = parquet_schema("y", ["n"], ["c"])
    one_row = tmp_path / "r.csv"
    one_row.write_text("y,n,c\n1,2.5,a\n")
    assert not no_data_rows(one_row, csv)
    for path, schema in ((header_only, csv), (zero, csv), (gz, csv), (parquet, pschema)):
        assert no_data_rows(path, schema), path
        item = InputFile(str(path), path, empty_ok=True)
        for passes in (iter_input_passes([item], schema, 4, 100, Positions()),
                       iter_rank_pass_inputs([item], schema, 4, 100, 1, 2, Positions())):
            assert list(passes) == []
        with pytest.raises(DataError, match=str(path)):
            list(iter_input_passes([InputFile(str(path), path)], schema, 4, 100,
                                   Positions()))
    # A file with rows among them trains its rows.
    items = [InputFile(str(p), p, empty_ok=True) for p in (zero, one_row, header_only)]
    passes = list(iter_input_passes(items, csv, 4, 100, Positions()))
    assert sum(len(b.labels) for b in passes[0][0]) == 1


def test_bad_rows_after_a_resumed_start_are_counted(tmp_path):
    """Resumed after bad rows were skipped, a file is read from its start and the rows
    before ``start`` dropped: the bad rows met after ``start`` were dropped from the
    count too, so metrics and checkpoint marks missed them."""
    path = tmp_path / "f.tsv"
    generate(path, 100, model_seed=1, sample_seed=1)
    lines = path.read_text().splitlines(keepends=True)
    bad = "not\ta\tgood\trow\n"
    path.write_text("".join(lines[:5] + [bad] + lines[5:60] + [bad, bad] + lines[60:]))
    stats = ReadStats()
    tables = list(iter_tables_from(path, FeatureSchema.criteo(), 16, 20, seek=False,
                                   on_bad_row="skip", stats=stats, skipped_before=1))
    assert sum(t.num_rows for t in tables) == 80
    assert stats.skipped == 2 and len(stats.examples) == 2
