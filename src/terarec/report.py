"""A one-page HTML report of a training run: per-pass curves, throughput, final numbers.

The page is self-contained (inline CSS, no scripts, PNGs beside it referenced by
relative name), so a run folder can be copied, zipped or served statically and still
render. Plots use matplotlib's object API on the Agg canvas rather than ``pyplot``: no
global backend switch, no figure registry to leak, safe to call from any thread.

Layout written by :func:`write_report`::

    out_dir/
      report.html
      loss.png         train loss and validation log loss per pass
      auc.png          validation AUC per pass (+ dashed ceiling when known)
      throughput.png   training samples/s per pass
      tasks.png        with several labels: each task's validation AUC per pass
      tasks_logloss.png  ... and each task's validation log loss per pass

A plot is written only when the history holds at least one value for it.
"""

from __future__ import annotations

import html
import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, MaxNLocator

from terarec.io import atomic_write_bytes, atomic_write_text

__all__ = ["plot_bars", "plot_xy", "write_report", "write_search_report", "gap_closed"]

CHANCE_AUC = 0.5
_PALETTE = ("#2563eb", "#ea580c", "#16a34a", "#9333ea", "#dc2626", "#0891b2")
_NEGATIVE_COLOR = "#dc2626"
_DPI = 110

# (key in history items, legend label) per plot; the order is the order on the page.
_LOSS_SERIES = (("train_loss", "train loss"), ("valid_logloss", "validation log loss"))
_AUC_SERIES = (("valid_auc", "validation AUC"),)
_THROUGHPUT_SERIES = (("samples_per_s", "training samples/s"),)
# train --follow: each pass scored before it trained (train/progressive.py)
_PROGRESSIVE_SERIES = (("progressive_auc", "progressive AUC"),
                       ("progressive_logloss", "progressive log loss"))
# Admission and eviction (docs/admission.md): the store's size and what each pass changed.
_KEY_SERIES = (("store_keys", "keys in the store"), ("new_keys", "admitted"),
               ("rejected_keys", "rejected"), ("evicted_keys", "evicted"))

_LABELS = {
    "auc": "AUC", "valid_auc": "validation AUC", "ceiling_auc": "ceiling AUC",
    "logloss": "log loss", "valid_logloss": "validation log loss",
    "train_loss": "train loss", "samples_per_s": "samples / s", "staging_s": "staging (s)",
    "store_keys": "store keys", "new_keys": "keys admitted", "rejected_keys": "keys rejected",
    "evicted_keys": "keys evicted",
}


# --------------------------------------------------------------------------- plots


def _short(value: float) -> str:
    """A label that stays readable for AUC gains (0.0041), row counts and byte counts:
    SI suffixes from a million up, thousands separators below, 4 digits under 10,000."""
    for scale, suffix in ((1e12, "T"), (1e9, "G"), (1e6, "M")):
        if abs(value) >= scale:
            return f"{value / scale:.3g}{suffix}"
    return f"{value:,.0f}" if abs(value) >= 10_000 else f"{value:.4g}"


def _new_axes(figsize: tuple[float, float]):
    fig = Figure(figsize=figsize, dpi=_DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.spines[["top", "right"]].set_visible(False)
    ax.grid(True, color="#e5e7eb", linewidth=0.8)
    ax.set_axisbelow(True)
    return fig, ax


def _save(fig: Figure, path: Path) -> Path:
    # Render to memory first so a crash mid-draw never leaves a truncated PNG behind.
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI)
    atomic_write_bytes(path, buf.getvalue())
    return path


def plot_xy(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    title: str,
    xlabel: str,
    ylabel: str,
    *,
    hlines: Mapping[str, float] | None = None,
    y_from_zero: bool = False,
) -> Path:
    """Line chart of named ``(xs, ys)`` series, plus optional dashed horizontal
    reference lines (``{label: y}``, e.g. a ceiling AUC). ``y_from_zero`` anchors the
    y axis at 0 where a cropped axis would exaggerate noise (throughput). Returns ``path``."""
    if not series:
        raise ValueError(f"plot_xy({path}): no series to plot")
    for name, (xs, ys) in series.items():
        if len(xs) != len(ys):
            raise ValueError(f"plot_xy({path}): series {name!r} has {len(xs)} x values "
                             f"but {len(ys)} y values")
    fig, ax = _new_axes((6.4, 3.6))
    for i, (name, (xs, ys)) in enumerate(series.items()):
        color = _PALETTE[i % len(_PALETTE)]
        ax.plot(xs, ys, marker="o", markersize=4, linewidth=1.8, color=color, label=name)
    for j, (name, y) in enumerate((hlines or {}).items()):
        color = _PALETTE[(len(series) + j) % len(_PALETTE)]
        ax.axhline(y, linestyle="--", linewidth=1.4, color=color, label=f"{name} ({y:.4g})")
    all_x = [float(x) for xs, _ in series.values() for x in xs]
    if all_x and all(x.is_integer() for x in all_x):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # passes, not pass 2.5
    all_y = [abs(float(y)) for _, ys in series.values() for y in ys]
    if all_y and max(all_y) >= 10_000:
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    if y_from_zero:
        top = max([float(y) for _, ys in series.values() for y in ys], default=0.0)
        ax.set_ylim(0, top * 1.1 if top > 0 else 1.0)
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.margins(x=0.04)
    ax.legend(frameon=False, fontsize=9)
    return _save(fig, Path(path))


def plot_bars(
    path: str | Path,
    labels: Sequence[str],
    values: Sequence[float],
    title: str,
    xlabel: str,
) -> Path:
    """Horizontal bar chart, first label on top, each bar annotated with its value.
    Negative values (e.g. a feature that cost AUC) extend left in a warning colour."""
    if len(labels) != len(values):
        raise ValueError(f"plot_bars({path}): {len(labels)} labels but {len(values)} values")
    if not labels:
        raise ValueError(f"plot_bars({path}): nothing to plot")
    values = [float(v) for v in values]
    fig, ax = _new_axes((6.4, max(2.4, 0.34 * len(labels) + 1.2)))
    ax.grid(True, axis="x", color="#e5e7eb", linewidth=0.8)
    ax.grid(False, axis="y")
    colors = [_NEGATIVE_COLOR if v < 0 else _PALETTE[0] for v in values]
    positions = range(len(labels))
    bars = ax.barh(positions, values, color=colors, height=0.65)
    ax.set_yticks(list(positions), [str(label) for label in labels])
    ax.invert_yaxis()
    ax.axvline(0, color="#6b7280", linewidth=0.8)
    ax.bar_label(bars, labels=[f" {_short(v)} " for v in values], fontsize=8, color="#374151")
    if max(abs(v) for v in values) >= 10_000:
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: _short(v)))
    # Leave room for the value labels past the longest bar on either side.
    low, high = min(0.0, *values), max(0.0, *values)
    pad = 0.15 * ((high - low) or 1.0)
    ax.set_xlim(low - (pad if low < 0 else 0), high + (pad if high > 0 else 0))
    ax.set_title(title, loc="left", fontsize=11, fontweight="bold")
    ax.set_xlabel(xlabel)
    return _save(fig, Path(path))


# --------------------------------------------------------------------------- history


def _number(value: object, where: str) -> float | None:
    """A finite-or-nan float from a history/summary value; ``None`` stays missing."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{where} is {value!r}, expected a number")
    return float(value)


def _pass_numbers(history: Sequence[Mapping]) -> list[float]:
    """The x value of each history item: its ``pass`` when given, else its position."""
    xs = []
    for i, item in enumerate(history):
        if not isinstance(item, Mapping):
            raise ValueError(f"history[{i}] is {type(item).__name__}, expected a dict")
        x = _number(item.get("pass"), f"history[{i}]['pass']")
        xs.append(float(i + 1) if x is None else x)
    return xs


def _series(
    history: Sequence[Mapping], xs: Sequence[float], keys: Sequence[tuple[str, str]]
) -> dict[str, tuple[list[float], list[float]]]:
    """The points each key has (items lacking it, or holding nan, are skipped)."""
    out = {}
    for key, label in keys:
        points: list[tuple[float, float]] = []
        for i, (x, item) in enumerate(zip(xs, history, strict=True)):
            y = _number(item.get(key), f"history[{i}][{key!r}]")
            if y is not None and math.isfinite(y):
                points.append((x, y))
        if points:
            out[label] = ([x for x, _ in points], [y for _, y in points])
    return out


def _task_names(history: Sequence[Mapping]) -> list[str]:
    """The tasks of a run with several labels, in the order the history names them:
    each ``valid_auc_<task>`` / ``progressive_auc_<task>`` key. A single-label run has
    none."""
    names: dict[str, None] = {}
    for item in history:
        for key in item:
            for prefix in ("valid_auc_", "progressive_auc_"):
                if str(key).startswith(prefix):
                    names[str(key)[len(prefix):]] = None
    return list(names)


def _task_table(tasks: Sequence[str], summary: Mapping,
                history: Sequence[Mapping]) -> str:
    """One row per task: its final figures (the summary's, else the last pass's)."""
    rows = []
    for task in tasks:
        row: dict[str, object] = {"task": task}
        for key, label in (("auc", "AUC"), ("logloss", "log loss"), ("ctr", "label rate"),
                           ("mean_prediction", "mean prediction")):
            value = summary.get(f"{key}_{task}")
            if value is None:
                value = next((h[f"valid_{key}_{task}"] for h in reversed(history)
                              if h.get(f"valid_{key}_{task}") is not None), None)
            row[label] = value
        rows.append(row)
    return f"<h2>Per task</h2>{_rows_table(rows)}"


def _final_auc(summary: Mapping, history: Sequence[Mapping]) -> float | None:
    for key in ("auc", "valid_auc"):
        if summary.get(key) is not None:
            return _number(summary[key], f"summary[{key!r}]")
    for i in reversed(range(len(history))):
        if history[i].get("valid_auc") is not None:
            return _number(history[i]["valid_auc"], f"history[{i}]['valid_auc']")
    return None


def gap_closed(auc: float, ceiling_auc: float) -> float | None:
    """Share of the distance from chance (AUC 0.5) to ``ceiling_auc`` that ``auc`` covers;
    ``None`` when the ceiling is not above chance (the share is undefined)."""
    if not ceiling_auc > CHANCE_AUC:
        return None
    return (auc - CHANCE_AUC) / (ceiling_auc - CHANCE_AUC)


# --------------------------------------------------------------------------- html

_CSS = """
:root { --ink:#111827; --muted:#6b7280; --line:#e5e7eb; --accent:#2563eb; --bg:#f9fafb; }
* { box-sizing: border-box; }
body { margin:0; background:var(--bg); color:var(--ink);
       font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,Helvetica,Arial,sans-serif; }
main { max-width:1000px; margin:0 auto; padding:32px 24px 48px; }
h1 { font-size:26px; margin:0 0 4px; }
h2 { font-size:17px; margin:32px 0 12px; color:#1f2937; }
.sub { color:var(--muted); margin:0 0 24px; }
.card { background:#fff; border:1px solid var(--line); border-radius:10px; padding:16px 20px; }
.headline { border-left:4px solid var(--accent); font-size:16px; margin-bottom:8px; }
.headline b { font-variant-numeric:tabular-nums; }
.bar { height:8px; background:var(--line); border-radius:4px; margin-top:10px; overflow:hidden; }
.bar > span { display:block; height:100%; background:var(--accent); }
table { border-collapse:collapse; width:100%; font-variant-numeric:tabular-nums; }
th, td { text-align:left; padding:7px 12px; border-bottom:1px solid var(--line); }
th { color:var(--muted); font-weight:600; font-size:13px; }
td.num { text-align:right; }
tr:last-child td { border-bottom:none; }
tbody tr:nth-child(even) { background:#fafafa; }
.history th { text-align:right; } .history th:first-child { text-align:left; }
code { font:13px ui-monospace,SFMono-Regular,Menlo,Consolas,monospace;
       background:#f3f4f6; padding:1px 5px; border-radius:4px; word-break:break-all; }
.plots { display:grid; grid-template-columns:repeat(auto-fit,minmax(420px,1fr)); gap:16px; }
figure { margin:0; } figure img { width:100%; height:auto; display:block; }
.empty { color:var(--muted); font-style:italic; }
footer { color:var(--muted); font-size:12px; margin-top:32px; }
"""


def _label(key: str) -> str:
    return _LABELS.get(key, key.replace("_", " "))


def _format_number(value: float) -> str:
    if math.isnan(value):
        return "n/a"
    if math.isinf(value):
        return "∞" if value > 0 else "-∞"
    magnitude = abs(value)
    if magnitude >= 1000:
        return f"{value:,.0f}"
    if magnitude >= 10:
        return f"{value:,.2f}"
    return f"{value:.4f}"


def _cell(value: object) -> tuple[str, bool]:
    """HTML for one value, and whether it is numeric (right-aligned)."""
    if value is None:
        return "—", False
    if isinstance(value, bool):
        return ("yes" if value else "no"), False
    if isinstance(value, int):
        return f"{value:,}", True
    if isinstance(value, float):
        return _format_number(value), True
    if isinstance(value, Path) or (isinstance(value, str) and "/" in value):
        return f"<code>{html.escape(str(value))}</code>", False
    if isinstance(value, (list, tuple)):
        return ", ".join(_cell(v)[0] for v in value), False
    return html.escape(str(value)), False


def _flatten(summary: Mapping, prefix: str = "") -> list[tuple[str, object]]:
    """Nested dicts become ``outer / inner`` rows so the table stays two columns."""
    rows = []
    for key, value in summary.items():
        name = f"{prefix}{_label(str(key))}"
        if isinstance(value, Mapping):
            rows.extend(_flatten(value, f"{name} / "))
        else:
            rows.append((name, value))
    return rows


def _summary_table(summary: Mapping) -> str:
    if not summary:
        return '<p class="empty">No summary values were recorded.</p>'
    rows = []
    for name, value in _flatten(summary):
        text, numeric = _cell(value)
        cls = ' class="num"' if numeric else ""
        rows.append(f"<tr><th>{html.escape(name)}</th><td{cls}>{text}</td></tr>")
    return f'<div class="card"><table>{"".join(rows)}</table></div>'


def _history_table(history: Sequence[Mapping], xs: Sequence[float]) -> str:
    columns: list[str] = []
    for item in history:
        columns.extend(k for k in item if k != "pass" and k not in columns)
    head = "".join(f"<th>{html.escape(_label(c))}</th>" for c in ["pass", *columns])
    body = []
    for x, item in zip(xs, history, strict=True):
        cells = [f"<td>{x:g}</td>"]
        cells.extend(f'<td class="num">{_cell(item.get(column))[0]}</td>' for column in columns)
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="card"><table class="history"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def _headline(auc: float | None, ceiling: float | None, tasks: Sequence[str] = ()) -> str:
    if auc is None:
        return ""
    text = f"Final validation AUC <b>{auc:.4f}</b>"
    if tasks:  # several labels: ``auc`` is their weighted mean (train/metrics.py)
        text += f" (the label weights' mean over {', '.join(map(html.escape, tasks))})"
    share = None if ceiling is None else gap_closed(auc, ceiling)
    if ceiling is not None and share is None:
        text += (f". The ceiling AUC ({ceiling:.4f}) is not above chance (0.5), so the share "
                 f"of the gap closed is undefined.")
    elif share is not None:
        text += (f": the model closed <b>{share:.1%}</b> of the gap between chance "
                 f"(AUC 0.5) and the ceiling (AUC {ceiling:.4f}).")
        width = min(max(share, 0.0), 1.0)
        text += f'<div class="bar"><span style="width:{width:.1%}"></span></div>'
    else:
        text += "."
    return f'<div class="card headline">{text}</div>'


def write_report(
    out_dir: str | Path,
    history: Sequence[Mapping],
    summary: Mapping,
    title: str = "terarec run",
) -> Path:
    """Write ``out_dir/report.html`` and its plots; return the HTML path.

    ``history`` holds one dict per pass with any of ``pass``, ``rows``, ``train_loss``,
    ``valid_auc``, ``valid_logloss``, ``samples_per_s``, ``staging_s`` (missing keys and
    ``None`` are skipped). ``summary`` holds the final numbers (e.g. ``auc``, ``logloss``,
    ``ceiling_auc``, ``rows``, ``samples_per_s``, model file paths); with ``ceiling_auc``
    the page states the share of the chance-to-ceiling AUC gap the model closed.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    xs = _pass_numbers(history)
    ceiling = _number(summary.get("ceiling_auc"), "summary['ceiling_auc']")
    auc = _final_auc(summary, history)

    figures: list[tuple[str, str]] = []  # (file name, caption)
    loss = _series(history, xs, _LOSS_SERIES)
    if loss:
        plot_xy(out_dir / "loss.png", loss, "Loss per pass", "pass", "log loss")
        figures.append(("loss.png", "Training loss and validation log loss per pass"))
    auc_series = _series(history, xs, _AUC_SERIES)
    if auc_series:
        hlines = {"ceiling AUC": ceiling} if ceiling is not None else None
        plot_xy(out_dir / "auc.png", auc_series, "Validation AUC per pass", "pass", "AUC",
                hlines=hlines)
        figures.append(("auc.png", "Validation AUC per pass"))
    progressive = _series(history, xs, _PROGRESSIVE_SERIES)
    if progressive:
        plot_xy(out_dir / "progressive.png", progressive,
                "Progressive validation per pass (scored before training)", "pass", "value")
        figures.append(("progressive.png", "Progressive AUC and log loss: each pass scored "
                        "by the model before it trained on it"))
    tasks = _task_names(history)
    for name, key, heading, ylabel in (
            ("tasks.png", "valid_auc", "Validation AUC per task", "AUC"),
            ("tasks_logloss.png", "valid_logloss", "Validation log loss per task",
             "log loss"),
            ("tasks_progressive.png", "progressive_auc", "Progressive AUC per task",
             "AUC")):
        per_task = _series(history, xs, [(f"{key}_{t}", t) for t in tasks])
        if per_task:
            plot_xy(out_dir / name, per_task, heading, "pass", ylabel)
            figures.append((name, f"{heading}: {', '.join(per_task)}"))
    throughput = _series(history, xs, _THROUGHPUT_SERIES)
    if throughput:
        plot_xy(out_dir / "throughput.png", throughput, "Training throughput per pass",
                "pass", "samples / s", y_from_zero=True)
        figures.append(("throughput.png", "Training samples per second per pass"))
    keys = _series(history, xs, _KEY_SERIES)
    if keys:
        plot_xy(out_dir / "keys.png", keys, "Store keys per pass", "pass", "keys",
                y_from_zero=True)
        figures.append(("keys.png", "Keys in the store, and keys admitted, rejected and "
                        "evicted in each pass"))

    if figures:
        plots = "".join(
            f'<figure class="card"><img src="{html.escape(name)}" alt="{html.escape(caption)}">'
            f"</figure>" for name, caption in figures)
        plots = f'<div class="plots">{plots}</div>'
    else:
        plots = '<p class="empty">No per-pass values were recorded.</p>'
    history_html = _history_table(history, xs) if history else ""
    passes = f"{len(history)} pass{'es' if len(history) != 1 else ''}"
    files = [{"file": h["file_done"], "rows": h.get("file_rows"),
              "progressive AUC": h.get("file_auc"), "progressive log loss": h.get("file_logloss")}
             for h in history if h.get("file_done")]
    files_html = (f"<h2>Progressive validation per file</h2>{_rows_table(files)}"
                  if files else "")
    if tasks:
        files_html = _task_table(tasks, summary, history) + files_html
    values = summary.get("chosen_by_validation")
    if isinstance(values, list) and values:  # small data's start and bucket prior
        summary = {k: v for k, v in summary.items() if k != "chosen_by_validation"}
        files_html += _chosen_values_html(values)
    chosen = summary.get("chosen_settings")
    if isinstance(chosen, Mapping):  # the portfolio raced on the validation rows
        summary = {k: v for k, v in summary.items() if k != "chosen_settings"}
        files_html += _chosen_html(chosen)

    body = f"""{_headline(auc, ceiling, tasks)}
<h2>Summary</h2>
{_summary_table(summary)}
<h2>Per pass</h2>
{plots}
{files_html}
{f"<h2>History</h2>{history_html}" if history_html else ""}"""
    page = _page(title, f"Training report · {passes}", body)
    html_path = out_dir / "report.html"
    atomic_write_text(html_path, page)
    return html_path


# --------------------------------------------------------------------------- search


def _page(title: str, sub: str, body: str) -> str:
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title>
<style>{_CSS}</style>
</head>
<body>
<main>
<h1>{html.escape(title)}</h1>
<p class="sub">{html.escape(sub)}</p>
{body}
<footer>Generated by terarec.</footer>
</main>
</body>
</html>
"""


def _chosen_values_html(choices: Sequence[Mapping]) -> str:
    """Each value small data chose by validation: every value tried, what its run
    reached on the validation rows, which was kept."""
    rows = [{"setting": c.get("key"), "value": v.get("value"), "best validation value":
             v.get("best"), "kept": "yes" if v.get("value") == c.get("chosen") else ""}
            for c in choices if isinstance(c, Mapping)
            for v in c.get("validation") or [] if isinstance(v, Mapping)]
    return ("<h2>Values chosen by validation</h2><p>One run per value on the training "
            "rows, the better validation value kept.</p>" + _rows_table(rows)
            if rows else "")


def _chosen_html(chosen: Mapping) -> str:
    """The settings portfolio's race: every candidate, the rule, the budget used."""
    budget = chosen.get("budget") or {}
    rows = [{"member": c.get("name"), "values": json.dumps(c.get("params") or {}),
             "patience": c.get("patience"), "passes": c.get("passes"),
             "best pass": c.get("best_pass"), "valid AUC": c.get("valid_auc"),
             "valid log loss": c.get("valid_logloss"), "stopped": c.get("stop_reason")}
            for c in chosen.get("candidates") or []]
    said = (f"Chosen: <b>{html.escape(str(chosen.get('chosen')))}</b>. "
            f"{html.escape(str(chosen.get('rule', '')))} "
            f"(standard error {_cell(chosen.get('auc_standard_error'))[0]}). Budget: "
            f"{_cell(budget.get('passes'))[0]} passes, "
            f"{_cell(budget.get('used_x_default_run'))[0]}x the default run's "
            f"(limit {_cell(budget.get('limit_x_default_run'))[0]}x), "
            f"{_cell(budget.get('seconds'))[0]} s.")
    return (f"<h2>Settings chosen by validation</h2><p>{said}</p>"
            f"{_rows_table(rows) if rows else ''}")


def _rows_table(rows: Sequence[Mapping]) -> str:
    columns = list(dict.fromkeys(k for r in rows for k in r))
    head = "".join(f"<th>{html.escape(_label(c))}</th>" for c in columns)
    body = []
    for row in rows:
        cells = []
        for column in columns:
            text, numeric = _cell(row.get(column))
            cells.append(f'<td{" class=num" if numeric else ""}>{text}</td>')
        body.append(f"<tr>{''.join(cells)}</tr>")
    return (f'<div class="card"><table class="history"><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(body)}</tbody></table></div>")


def write_search_report(
    out_dir: str | Path,
    rows: Sequence[Mapping],
    curves: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    importances: Mapping[str, float],
    metric: str,
    summary: Mapping,
    title: str = "terarec search",
) -> Path:
    """Write ``out_dir/report.html`` for a search: the results table (``rows``, best
    first), every trial's validation ``metric`` per pass (``curves``: label -> xs, ys),
    optuna's parameter importances and ``summary``; return the HTML path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    figures: list[tuple[str, str]] = []
    drawn = {k: v for k, v in curves.items() if len(v[0])}
    if drawn:
        plot_xy(out_dir / "trials.png", drawn, f"Validation {metric} per pass, per trial",
                "pass", metric)
        figures.append(("trials.png", f"Validation {metric} of every trial per pass"))
    if importances:
        names = sorted(importances, key=importances.__getitem__, reverse=True)
        plot_bars(out_dir / "importance.png", names, [importances[n] for n in names],
                  "Parameter importance", "share of the objective's variance (fANOVA)")
        figures.append(("importance.png", "Parameter importance"))
    plots = "".join(
        f'<figure class="card"><img src="{html.escape(name)}" alt="{html.escape(caption)}">'
        f"</figure>" for name, caption in figures)
    body = (f"<h2>Summary</h2>{_summary_table(summary)}"
            f'<h2>Trials</h2><div class="plots">{plots}</div>' if plots else
            f"<h2>Summary</h2>{_summary_table(summary)}")
    if not importances:
        body += '<p class="empty">Parameter importance needs at least two finished ' \
                'trials whose parameters differ.</p>'
    body += f"<h2>Results</h2>{_rows_table(rows)}" if rows else ""
    html_path = out_dir / "report.html"
    atomic_write_text(html_path, _page(title, f"Search report · {len(rows)} trials", body))
    return html_path
