"""The report's charts: matplotlib figures written as inline SVG whose labels stay <text>.

Text is kept as text (svg.fonttype "none") so the page can be searched and a browser test can
measure every label; the page embeds the subset of DejaVu Sans that matplotlib measured them
with (font_face), so the browser lays each label out at the size matplotlib gave it room for.
Each chart is one Figure (no pyplot state), its element ids prefixed with the chart's id so many
charts share one document. Every data series carries an id `<chart>-series-<i>`.
"""

from __future__ import annotations

import base64
import io
import logging
import math
import re
from contextlib import contextmanager
from functools import lru_cache

RC = {
    "svg.fonttype": "none",
    "svg.hashsalt": "logit-matrix",
    "font.family": "DejaVu Sans",
    "font.size": 9,
    "axes.titlesize": 9,
    "axes.labelsize": 9,
    "legend.fontsize": 8,
    "xtick.labelsize": 8,
    "ytick.labelsize": 8,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e8e8e8",
    "text.parse_math": False,
}
COLOURS = [
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
    "#393b79",
    "#637939",
    "#8c6d31",
    "#843c39",
    "#7b4173",
    "#3182bd",
    "#e6550d",
    "#31a354",
]
DASHES = ["-", "--", ":", "-."]  # past the colours, series differ by dash as well
GLYPHS = "".join(chr(c) for c in range(32, 127)) + "±‖×·–—−≤≥…µσΔ°²³√"  # what labels may hold


def style(i: int) -> dict:
    """Series i's colour and dash: unique for the first len(COLOURS) * len(DASHES) series."""
    return {"color": COLOURS[i % len(COLOURS)], "linestyle": DASHES[(i // len(COLOURS)) % len(DASHES)]}


def _rc() -> dict:
    from cycler import cycler

    return {**RC, "axes.prop_cycle": cycler(color=COLOURS)}


@contextmanager
def drawing(width: float, height: float):
    """A Figure of width x height inches with constrained layout, drawn and saved inside the report's rc."""
    import matplotlib
    from matplotlib.figure import Figure

    with matplotlib.rc_context(_rc()):
        yield Figure(figsize=(width, height), layout="constrained")


def svg(fig, ident: str) -> str:
    """The figure as an <svg> element with id `ident`, class "chart", ids prefixed, no XML prolog."""
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None}, bbox_inches="tight", pad_inches=0.04)
    text = buf.getvalue()
    text = text[text.index("<svg") :]
    text = re.sub(r"\s*<metadata>.*?</metadata>", "", text, flags=re.S)  # RDF naming the tool: URLs, no content
    text = re.sub(r'\bid="([^"]+)"', lambda m: f'id="{ident}-{m.group(1)}"', text)
    text = re.sub(r'(url\(#|href="#)([^")]+)', lambda m: f"{m.group(1)}{ident}-{m.group(2)}", text)
    return text.replace("<svg ", f'<svg id="{ident}" class="chart" ', 1)


def log_ticks(axis) -> None:
    """Plain labels (1e-3, 2e-3) on a log axis, called once its data is drawn: decades on a wide
    axis, 1-2-5 or 1-2-3-5-7 on a narrow one, so even a span under one decade is read (8 and 9 sit
    within a twentieth of a decade of the next 1: their labels would touch it on a short axis).
    (matplotlib's own 10^x labels are mathtext: several text runs to one label.)"""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    lo, hi = sorted(axis.get_view_interval())
    span = math.log10(hi / lo) if lo > 0 else 99.0
    subs = (1.0,) if span > 2.5 else (1.0, 2.0, 5.0) if span > 1.0 else (1.0, 2.0, 3.0, 5.0, 7.0)
    axis.set_major_locator(LogLocator(base=10, subs=subs, numticks=7))  # decades thinned to ~7: a 12-decade axis fits
    axis.set_major_formatter(FuncFormatter(_sci))
    axis.set_minor_formatter(NullFormatter())


def _sci(v: float, _pos=None) -> str:
    if v <= 0:
        return ""
    e = math.floor(math.log10(v) + 1e-9)
    m = round(v / 10**e, 6)
    return f"1e{e}" if m == 1 else f"{m:g}e{e}"


@lru_cache(maxsize=1)
def font_face() -> str:
    """CSS @font-face rules embedding the DejaVu Sans glyphs of GLYPHS (regular and bold) as TrueType data URLs."""
    import os

    import matplotlib
    from fontTools import subset

    logging.getLogger("fontTools.subset").setLevel(logging.ERROR)  # it names each table it leaves out
    rules = []
    for weight, name in (("normal", "DejaVuSans.ttf"), ("bold", "DejaVuSans-Bold.ttf")):
        path = os.path.join(matplotlib.get_data_path(), "fonts", "ttf", name)
        opts = subset.Options()
        opts.name_IDs, opts.notdef_outline, opts.layout_features = ["*"], True, ["kern", "liga"]
        font = subset.load_font(path, opts)
        sub = subset.Subsetter(opts)
        sub.populate(text=GLYPHS)
        sub.subset(font)
        out = io.BytesIO()
        font.save(out)
        data = base64.b64encode(out.getvalue()).decode()
        rules.append(
            f"@font-face{{font-family:'DejaVu Sans';font-weight:{weight};"
            f"src:url(data:font/ttf;base64,{data}) format('truetype')}}"
        )
    return "".join(rules)


def no_data(text: str) -> str:
    import html

    return f'<p class="empty">{html.escape(text)}</p>'


def dots(
    rows: list[tuple[str, dict[str, float | None]]],
    ident: str,
    xlabel: str,
    log: bool = True,
    err: dict[str, float] | None = None,
) -> str:
    """One row per label, one marker per key of its dict (a legend names the keys); err: ± half-widths
    of the first key. A dot plot, not bars: on a log or a cut axis a bar's length would mean nothing."""
    keys = list(dict.fromkeys(k for _, d in rows for k, v in d.items() if v is not None and (v > 0 or not log)))
    if not keys:
        return no_data("No values to plot.")
    with drawing(6.4, 0.6 + 0.2 * len(rows)) as fig:
        return _dots(fig, rows, keys, ident, xlabel, log, err or {})


def _dots(fig, rows, keys, ident, xlabel, log, err) -> str:
    ax = fig.subplots()
    ys = list(range(len(rows)))[::-1]
    for i, k in enumerate(keys):
        pts = [
            (y, d[k], err.get(lab, 0.0) if i == 0 else 0.0)
            for y, (lab, d) in zip(ys, rows)
            if d.get(k) is not None and (d[k] > 0 or not log)
        ]
        lo = [min(e, v * 0.999) if log else e for _, v, e in pts]  # a log axis has no room below 0
        ax.errorbar(
            [v for _, v, _ in pts],
            [y for y, _, _ in pts],
            xerr=[lo, [e for *_, e in pts]],
            fmt="os^D"[i % 4],
            ms=4,
            capsize=2,
            color=COLOURS[i % len(COLOURS)],
            label=k,
            gid=f"series-{i}",
            linestyle="none",
        )
    ax.set_yticks(ys, [lab for lab, _ in rows])
    ax.set_ylim(-0.7, len(rows) - 0.3)
    ax.grid(axis="y", visible=False)
    if log:
        ax.set_xscale("log")
        log_ticks(ax.xaxis)
    ax.set_xlabel(xlabel)
    if len(keys) > 1:
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    return svg(fig, ident)


def lines(
    series: list[tuple[str, list[float], list[float]]],
    ident: str,
    xlabel: str,
    ylabel: str,
    xticks: list[str] | None = None,
    title: str | None = None,
) -> str:
    """One line with markers per (label, xs, ys), log y; xticks: names for x = 0, 1, ... (categorical)."""
    series = [
        (lab, [x for x, y in zip(xs, ys) if y and y > 0], [y for y in ys if y and y > 0]) for lab, xs, ys in series
    ]
    series = [s for s in series if s[1]]
    if not series:
        return no_data(f"No positive values of {ylabel}.")
    width = 6.4 if not xticks else max(6.4, 2.4 + 0.16 * len(xticks))
    with drawing(width, 2.8) as fig:
        ax = fig.subplots()
        _series_lines(ax, series, xlabel, ylabel, xticks, title)
        return svg(fig, ident)


def _series_lines(ax, series, xlabel, ylabel, xticks, title) -> None:
    for i, (lab, xs, ys) in enumerate(series):
        ax.plot(xs, ys, marker="o", ms=3, lw=1.2, label=lab, gid=f"series-{i}", **style(i))
    ax.set_yscale("log")
    log_ticks(ax.yaxis)
    if xticks:
        ax.set_xticks(range(len(xticks)), xticks, rotation=90 if len(xticks) > 6 else 0)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title, loc="left")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)


def cdf(series: list[tuple[str, list[float], list[float]]], ident: str) -> str:
    """The KLD distribution of each stack: (label, quantile values, their probabilities); log x, so a
    stack's rows with KL exactly 0 are where its curve starts above 0."""
    series = [(lab, [q for q in qs if q > 0], [p for q, p in zip(qs, ps) if q > 0]) for lab, qs, ps in series]
    series = [s for s in series if s[1]]
    if not series:
        return no_data("Every stack's rows equal its reference's: KL 0 throughout.")
    with drawing(6.4, 3.0) as fig:
        ax = fig.subplots()
        for i, (lab, qs, ps) in enumerate(series):
            ax.plot(qs, ps, lw=1.3, label=lab, gid=f"series-{i}", drawstyle="steps-post", **style(i))
        ax.set_xscale("log")
        log_ticks(ax.xaxis)
        ax.set_ylim(0, 1.01)
        ax.set_xlabel("KL(reference ‖ stack) of a row, nats")
        ax.set_ylabel("share of rows ≤ x")
        ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
        return svg(fig, ident)


# title characters that fit the width of a small multiple (2.3 in at 9 pt) for a stack's name, whose
# characters are lower case, digits and separators; 26 capitals would not fit
PANEL_CHARS = 26


def by_position(panels: list[dict], ident: str) -> str:
    """Small multiples, one per stack: the median over prompts of KL at each position and the band
    from its 10th to 90th percentile, shaded grey where fewer than two prompts reach that position
    (there the line is one prompt's, not a median). panels: {label, position, median, p10, p90, prompts}."""
    shown = [p for p in panels if any(v > 0 for v in p["median"] + p["p90"])]
    if not shown:
        return no_data("KL is 0 at every position of every stack.")
    cols = min(4, len(shown))
    nrows = math.ceil(len(shown) / cols)
    titles = [wrapped(p["label"], PANEL_CHARS) for p in shown]
    lines = max(t.count("\n") + 1 for t in titles)  # each row of panels makes room for the tallest title
    with drawing(2.3 * cols + 0.6, (1.55 + 0.15 * lines) * nrows + 0.5) as fig:
        axes = fig.subplots(nrows, cols, sharex=True, sharey=True, squeeze=False).ravel()
        for i, (ax, p, title) in enumerate(zip(axes, shown, titles)):
            _position_panel(ax, p, i)
            ax.set_title(title, loc="left")
        for ax in axes[len(shown) :]:
            ax.set_visible(False)
        for i, ax in enumerate(axes[: len(shown)]):
            ax.label_outer()
            if i + cols >= len(shown):  # the lowest panel of its column, whatever row it is in
                ax.tick_params(labelbottom=True)
        axes[0].set_yscale("log")
        log_ticks(axes[0].yaxis)
        fig.supxlabel("position in the prompt", fontsize=9)
        fig.supylabel("KL(reference ‖ stack), nats", fontsize=9)
        return svg(fig, ident)


def _position_panel(ax, p: dict, i: int) -> None:
    x = p["position"]
    pos = [(a, b, c, d) for a, b, c, d in zip(x, p["median"], p["p10"], p["p90"]) if d > 0]
    if pos:
        xs, med, lo, hi = (list(t) for t in zip(*pos))
        floor = min(v for v in med + hi if v > 0) / 10  # a band reaching 0 drawn down to the axis
        ax.fill_between(xs, [max(v, floor) for v in lo], hi, color=COLOURS[0], alpha=0.22, lw=0, gid=f"band-{i}")
        ax.plot(xs, [max(v, floor) for v in med], color=COLOURS[0], lw=1.2, marker="o", ms=2, gid=f"series-{i}")
    for a, b in _runs([xx for xx, n in zip(x, p["prompts"]) if n < 2], x):
        ax.axvspan(a, b, color="#bbbbbb", alpha=0.35, lw=0)


def wrapped(label: str, width: int) -> str:
    """label on lines of at most width characters, broken after a '/', '+' or '-' where one falls
    (a stack's name: `llamacpp/q4_k_m/model-q4_k_m+attn_q-q8_0.gguf`), else where a line is full."""
    if width < 1:
        raise ValueError(f"wrapped: width {width}: a line holds at least one character")
    lines, line = [], ""
    for piece in filter(None, re.findall(r"[^/+-]*[/+-]?", label)):  # each piece ends at its break
        if line and len(line) + len(piece) > width:
            lines.append(line)
            line = ""
        line += piece
        while len(line) > width:  # a piece longer than a line
            lines.append(line[:width])
            line = line[width:]
    return "\n".join([*lines, line] if line else lines)


def _runs(few: list[int], xs: list[int]) -> list[tuple[float, float]]:
    """Consecutive positions of `few` (within the sorted xs) as (start, end) spans."""
    out, idx = [], {x: i for i, x in enumerate(xs)}
    for x in few:
        if out and idx[x] == idx[out[-1][1]] + 1:
            out[-1] = (out[-1][0], x)
        else:
            out.append((x, x))
    return [(a, b) if a != b else (a - 0.5, b + 0.5) for a, b in out]


def heatmap(labels: list[str], values: dict[tuple[str, str], float], ident: str, what: str) -> str:
    """Every pair of stacks: labels on both axes, a log colour scale; blank where a stack meets
    itself or two stacks' rows are identical (0 has no place on a log scale)."""
    import numpy as np
    from matplotlib.colors import LogNorm

    n = len(labels)
    if n < 2:
        return no_data("One stack: no pairs.")
    grid = np.full((n, n), np.nan)
    for i, a in enumerate(labels):
        for j, b in enumerate(labels):
            v = values.get((a, b), values.get((b, a)))
            if i != j and v is not None and v > 0:
                grid[i, j] = v
    if np.isnan(grid).all():
        return no_data("Every pair of stacks has identical rows.")
    side = max(2.4, 0.22 * n)
    longest = max(len(s) for s in labels) * 0.065
    with drawing(side + longest + 1.4, side + longest + 0.4) as fig:
        ax = fig.subplots()
        lo, hi = np.nanmin(grid), np.nanmax(grid)
        im = ax.imshow(
            np.ma.masked_invalid(grid), cmap="viridis", norm=LogNorm(lo, hi if hi > lo else lo * 10), gid="series-0"
        )
        ax.set_xticks(range(n), labels, rotation=90)
        ax.set_yticks(range(n), labels)
        ax.grid(False)
        ax.tick_params(length=0)
        bar = fig.colorbar(im, ax=ax, shrink=0.8)
        bar.set_label(what)
        log_ticks(bar.ax.yaxis)
        return svg(fig, ident)
