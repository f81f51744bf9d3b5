"""The HTML run report and its plot helpers."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
from PIL import Image

from terarec.report import gap_closed, plot_bars, plot_xy, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _history(passes: int = 5) -> list[dict]:
    return [
        {
            "pass": p,
            "rows": 100_000,
            "train_loss": 0.55 - 0.02 * p,
            "valid_auc": 0.70 + 0.01 * p,
            "valid_logloss": 0.50 - 0.01 * p,
            "samples_per_s": 150_000.0 + 1000 * p,
            "staging_s": 0.8,
        }
        for p in range(1, passes + 1)
    ]


def _check_png(path: Path) -> tuple[int, int]:
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as img:
        img.verify()
    with Image.open(path) as img:
        width, height = img.size
    assert 400 <= width <= 2000 and 200 <= height <= 2000, (path, img.size)
    return width, height


def _img_sources(html: str) -> set[str]:
    return set(re.findall(r'<img src="([^"]+)"', html))


def test_full_report_writes_plots_and_summary(tmp_path: Path) -> None:
    model_file = tmp_path / "model" / "dense.safetensors"
    summary = {
        "auc": 0.75,
        "logloss": 0.4512,
        "ceiling_auc": 0.80,
        "rows": 2_000_000,
        "samples_per_s": 181_234.5,
        "dense_weights": model_file,
    }
    html_path = write_report(tmp_path / "run", _history(), summary, title="Criteo sample")

    assert html_path == tmp_path / "run" / "report.html"
    html = html_path.read_text()
    assert _img_sources(html) == {"loss.png", "auc.png", "throughput.png"}
    for name in _img_sources(html):
        _check_png(html_path.parent / name)
    # Summary values, formatted for people.
    for text in ("0.7500", "0.4512", "0.8000", "2,000,000", "181,234", str(model_file)):
        assert text in html, text
    # (0.75 - 0.5) / (0.80 - 0.5) of the gap between chance and the ceiling.
    assert "83.3%" in html
    assert "<title>Criteo sample</title>" in html
    # Self-contained: no external stylesheets or scripts.
    assert "<style>" in html and "<script" not in html and "http" not in html


def test_missing_keys_plot_only_what_is_there(tmp_path: Path) -> None:
    history = [{"train_loss": 0.6}, {"train_loss": 0.5, "valid_auc": None}, {"rows": 10}]
    html = write_report(tmp_path, history, {"rows": 30}).read_text()

    assert _img_sources(html) == {"loss.png"}
    assert not (tmp_path / "auc.png").exists()
    assert not (tmp_path / "throughput.png").exists()
    _check_png(tmp_path / "loss.png")
    # Items without a pass number are numbered by position.
    rows = re.findall(r"<tr><td>(\d+)</td>", html)
    assert rows == ["1", "2", "3"]
    # No AUC anywhere, so no headline and no gap statement.
    assert "headline" not in html.split("</style>")[1]


def test_empty_history_and_summary_still_render(tmp_path: Path) -> None:
    html = write_report(tmp_path, [], {}).read_text()
    assert _img_sources(html) == set()
    assert "No per-pass values" in html and "No summary values" in html
    assert list(tmp_path.glob("*.png")) == []


def test_nan_points_are_skipped(tmp_path: Path) -> None:
    history = [{"pass": 1, "valid_auc": math.nan}, {"pass": 2, "valid_auc": math.nan}]
    html = write_report(tmp_path, history, {}).read_text()
    assert "auc.png" not in html


def test_final_auc_falls_back_to_last_history_value(tmp_path: Path) -> None:
    html = write_report(tmp_path, _history(3), {"ceiling_auc": 0.9}).read_text()
    # Last pass AUC is 0.73: (0.73 - 0.5) / (0.9 - 0.5) = 57.5 %.
    assert "0.7300" in html and "57.5%" in html


def test_ceiling_at_chance_is_reported_as_undefined(tmp_path: Path) -> None:
    html = write_report(tmp_path, [], {"auc": 0.6, "ceiling_auc": 0.5}).read_text()
    assert "undefined" in html
    assert "%" not in html.split("<h2>Summary</h2>")[0].split("</style>")[1]


def test_ceiling_line_changes_the_auc_plot(tmp_path: Path) -> None:
    write_report(tmp_path / "a", _history(), {})
    write_report(tmp_path / "b", _history(), {"ceiling_auc": 0.80})
    with Image.open(tmp_path / "a" / "auc.png") as a, Image.open(tmp_path / "b" / "auc.png") as b:
        assert a.size == b.size
        assert a.tobytes() != b.tobytes()


def test_text_is_escaped(tmp_path: Path) -> None:
    html = write_report(tmp_path, [], {"note": "<b>x</b> & y"}, title="<script>").read_text()
    assert "<script>" not in html
    assert "&lt;script&gt;" in html and "&lt;b&gt;x&lt;/b&gt; &amp; y" in html


def test_non_numeric_history_value_names_the_item_and_key(tmp_path: Path) -> None:
    history = [{"pass": 1, "valid_auc": 0.7}, {"pass": 2, "valid_auc": "high"}]
    with pytest.raises(ValueError, match=r"history\[1\]\['valid_auc'\] is 'high'"):
        write_report(tmp_path, history, {})
    with pytest.raises(ValueError, match=r"history\[0\] is list"):
        write_report(tmp_path, [[1, 2]], {})


@pytest.mark.parametrize(
    ("auc", "ceiling", "expected"),
    [(0.75, 0.80, 0.25 / 0.30), (0.5, 0.8, 0.0), (0.8, 0.8, 1.0), (0.45, 0.7, -0.25),
     (0.7, 0.5, None), (0.7, 0.4, None)],
)
def test_gap_closed(auc: float, ceiling: float, expected: float | None) -> None:
    share = gap_closed(auc, ceiling)
    if expected is None:
        assert share is None
    else:
        assert share == pytest.approx(expected)


def test_plot_bars_grows_with_label_count(tmp_path: Path) -> None:
    few = plot_bars(tmp_path / "few.png", ["a", "b"], [0.1, -0.05], "Gain", "AUC gain")
    many_labels = [f"feature {i}" for i in range(30)]
    many = plot_bars(tmp_path / "many.png", many_labels, list(range(30)), "Gain", "AUC gain")
    _, few_height = _check_png(few)
    _, many_height = _check_png(many)
    assert many_height > 2 * few_height


def test_plot_helpers_reject_mismatched_inputs(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="2 labels but 1 values"):
        plot_bars(tmp_path / "x.png", ["a", "b"], [1.0], "t", "x")
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_bars(tmp_path / "x.png", [], [], "t", "x")
    with pytest.raises(ValueError, match="series 'fp32' has 3 x values but 2 y values"):
        plot_xy(tmp_path / "x.png", {"fp32": ([1, 2, 3], [1.0, 2.0])}, "t", "x", "y")
    with pytest.raises(ValueError, match="no series"):
        plot_xy(tmp_path / "x.png", {}, "t", "x", "y")
    assert not (tmp_path / "x.png").exists()


def test_plot_xy_draws_several_series(tmp_path: Path) -> None:
    series = {"fp32": ([1, 2, 3], [0.80, 0.81, 0.82]), "int8": ([1, 2, 3], [0.79, 0.80, 0.81])}
    path = plot_xy(tmp_path / "sub" / "xy.png", series, "AUC by bits", "pass", "AUC",
                   hlines={"ceiling": 0.85})
    assert path == tmp_path / "sub" / "xy.png"
    _check_png(path)


def test_admission_and_eviction_counts_get_a_plot_and_history_columns(tmp_path: Path) -> None:
    history = [{"pass": p, "train_loss": 0.6, "store_keys": 100 * p, "new_keys": 120,
                "rejected_keys": 300 - p, "evicted_keys": 20 * p} for p in range(1, 4)]
    html = write_report(tmp_path, history, {}).read_text()
    assert _img_sources(html) == {"loss.png", "keys.png"}
    _check_png(tmp_path / "keys.png")
    for header in ("store keys", "keys admitted", "keys rejected", "keys evicted"):
        assert f"<th>{header}</th>" in html
    assert '<td class="num">299</td>' in html


def test_several_labels_get_a_curve_and_a_row_per_task(tmp_path: Path) -> None:
    history = [{**h, "valid_auc_click": 0.70 + 0.01 * h["pass"],
                "valid_auc_conversion": 0.80 - 0.01 * h["pass"],
                "valid_logloss_click": 0.5, "valid_logloss_conversion": 0.1}
               for h in _history(3)]
    summary = {"auc": 0.74, "auc_click": 0.73, "auc_conversion": 0.77,
               "logloss_click": 0.5, "logloss_conversion": 0.1}
    html = write_report(tmp_path / "run", history, summary).read_text()
    assert {"tasks.png", "tasks_logloss.png"} <= _img_sources(html)
    _check_png(tmp_path / "run" / "tasks.png")
    section = html.split("<h2>Per task</h2>")[1].split("</table>")[0]
    assert "click" in section and "conversion" in section
    assert "0.7700" in section and "0.7300" in section
    # one label: no per-task figures or table
    single = write_report(tmp_path / "one", _history(3), {"auc": 0.7}).read_text()
    assert "tasks.png" not in single and "Per task" not in single


def test_values_chosen_by_validation_get_a_table_of_every_value_tried(tmp_path: Path) -> None:
    summary = {"auc": 0.7, "chosen_by_validation": [
        {"key": "sparse_optimizer.initial_accumulator", "chosen": 0.001,
         "validation": [{"value": 0.0, "best": 0.4467}, {"value": 0.001, "best": 0.4451}]},
        {"key": "sparse_optimizer.bucket_l2", "chosen": 0.0,
         "validation": [{"value": 0.0, "best": 0.4451}, {"value": 1.0, "best": 0.4488}]}]}
    html = write_report(tmp_path / "run", _history(), summary).read_text()
    section = html[html.index("Values chosen by validation"):]
    for text in ("sparse_optimizer.initial_accumulator", "sparse_optimizer.bucket_l2",
                 "0.4467", "0.4451", "0.4488"):
        assert text in section, text
    assert section.count(">yes<") == 2  # one value kept per setting
