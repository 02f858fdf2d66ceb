"""The report's small multiples of KL by position keep each stack's name over its own panel: a name
wider than a panel is broken onto lines after its '/', '+' and '-' (analysis/report_plots.py
wrapped), so an attribution's 27 stacks do not write their names over each other's."""

from __future__ import annotations

import itertools

import pytest

from analysis import report_plots as P

GROUPS = ("token_embd", "attn_q", "attn_output", "ffn_down", "first_third", "middle_third")
NAMES = ["llamacpp/f16", "llamacpp/q4_k_m/model-q4_k_m.gguf"] + [
    f"llamacpp/q4_k_m/model-q4_k_m+{g}-{t}.gguf" for g in GROUPS for t in ("q8_0", "q2_k")
]


def test_a_width_under_one_character_is_refused():
    with pytest.raises(ValueError, match="width 0"):
        P.wrapped("llamacpp/f16", 0)


@pytest.mark.parametrize("name", [*NAMES, "hf/bf16/eager/batch8", "x" * 70, "a/" + "b" * 40 + "/c", "///", ""])
def test_a_name_is_broken_after_its_separators_into_lines_that_fit(name):
    text = P.wrapped(name, P.PANEL_CHARS)
    lines = text.split("\n")
    assert "".join(lines) == name
    assert all(0 < len(line) <= P.PANEL_CHARS for line in lines) or text == name == ""
    for line in lines[:-1]:  # a line ends at a separator unless a piece alone is longer than a line
        assert line[-1] in "/+-" or len(line) == P.PANEL_CHARS, lines
    if len(name) <= P.PANEL_CHARS:
        assert lines == [name]


def test_no_panels_title_reaches_another_panel_or_title(monkeypatch):
    drawn = []

    def keep(fig, ident):
        drawn.append(fig)
        return ""

    monkeypatch.setattr(P, "svg", keep)
    panels = [
        {
            "label": name,
            "position": [0, 16, 32, 48],
            "median": [0.05, 0.04, 0.06, 0.05],
            "p10": [0.02] * 4,
            "p90": [0.1] * 4,
            "prompts": [5] * 4,
        }
        for name in NAMES
    ]
    P.by_position(panels, "kld-position")
    (fig,) = drawn
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)  # the constrained layout, as the report's savefig runs it
    axes = [ax for ax in fig.axes if ax.get_visible() and ax.get_title(loc="left")]
    assert [ax.get_title(loc="left").replace("\n", "") for ax in axes] == NAMES
    titles = {ax: _title(ax) for ax in axes}
    boxes = {ax: t.get_window_extent(renderer) for ax, t in titles.items()}
    for a, b in itertools.combinations(axes, 2):
        assert not boxes[a].overlaps(boxes[b]), (a.get_title(loc="left"), b.get_title(loc="left"))
        assert not boxes[a].overlaps(b.get_window_extent(renderer)), a.get_title(loc="left")
        assert not boxes[b].overlaps(a.get_window_extent(renderer)), b.get_title(loc="left")
    assert max(b.height for b in boxes.values()) > 2 * min(b.height for b in boxes.values())  # broken names


def _title(ax):
    """The Text artist of an axes' left title (set_title(loc="left"))."""
    from matplotlib.text import Text

    text = ax.get_title(loc="left")
    (t,) = [c for c in ax.get_children() if isinstance(c, Text) and c.get_text() == text]
    return t
