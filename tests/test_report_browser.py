"""The HTML report in headless Chromium (Debian `chromium`; .ci/run installs it): every chart drawn,
no two text labels overlapping (their bounding boxes, as the browser lays them out with the
embedded font), charts labelled by stack name, no console errors."""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, run_cli, sql

pytestmark = pytest.mark.slow  # the session's `swept` sweep runs on a Ray cluster

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--enable-logging=stderr",
    "--v=0",
]
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (.ci/run installs it)")

# Run in the page once its fonts are loaded: each chart's size, its series, its labels, and every
# pair of labels on the page whose boxes overlap by more than half a pixel each way.
LAYOUT_JS = """
document.fonts.ready.then(() => {
  const data = document.getElementById('data');
  const parses = (text) => { try { JSON.parse(text); return true; } catch (e) { return false; } };
  const out = {charts: [], overlaps: [], data: data ? parses(data.textContent) : null,
               font: [...document.fonts].some(f => f.family.includes('DejaVu Sans') && f.status === 'loaded')};
  const all = [];
  for (const svg of document.querySelectorAll('svg.chart')) {
    const r = svg.getBoundingClientRect();
    const texts = [...svg.querySelectorAll('text')].filter(t => t.textContent.trim())
      .map(t => ({chart: svg.id, t: t.textContent, r: t.getBoundingClientRect()}));
    all.push(...texts);
    const series = new Set([...svg.querySelectorAll('[id*="-series-"]')].map(e => e.id));
    out.charts.push({id: svg.id, w: r.width, h: r.height, series: series.size, labels: texts.map(x => x.t)});
  }
  for (let i = 0; i < all.length; i++) for (let j = i + 1; j < all.length; j++) {
    const a = all[i].r, b = all[j].r;
    const w = Math.min(a.right, b.right) - Math.max(a.left, b.left);
    const h = Math.min(a.bottom, b.bottom) - Math.max(a.top, b.top);
    if (w > 0.5 && h > 0.5) out.overlaps.push([all[i].chart, all[i].t, all[j].chart, all[j].t, w, h]);
  }
  const pre = document.createElement('pre');
  pre.id = 'layout-check';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
});
"""


def rendered(page: Path, profile: Path) -> tuple[str, list[str]]:
    """(the DOM Chromium renders from a report page, its console lines); without Chromium
    (.ci/run installs it) the page as written and no console."""
    if CHROMIUM is None:
        return page.read_text(), []
    out = subprocess.run(
        [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [ln for ln in out.stderr.splitlines() if "CONSOLE" in ln]


def layout(page: Path, work: Path) -> dict:
    """The page measured in Chromium (LAYOUT_JS's result), and its console lines under "console"."""
    work.mkdir(parents=True, exist_ok=True)
    probe = work / "probe.html"
    probe.write_text(page.read_text().replace("</body>", f"<script>{LAYOUT_JS}</script></body>"))
    out = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={work / 'profile'}",
            "--window-size=1300,2000",
            "--virtual-time-budget=20000",
            "--dump-dom",
            probe.as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    found = re.search(r'<pre id="layout-check">(.*?)</pre>', out.stdout, re.S)
    assert found, "the layout probe never ran (fonts never loaded?)"
    got = json.loads(html.unescape(found.group(1)))
    got["console"] = [ln for ln in out.stderr.splitlines() if "CONSOLE" in ln]
    return got


def check_report(wh: Path, work: Path, charts: list[str]) -> dict:
    """Report wh; assert the charts named are drawn with series, labels never overlap and name stacks
    by their short names; returns the layout."""
    r = run_cli("report", "--warehouse", str(wh), "--out", str(work / "rep"))
    assert r.returncode == 0, r.stderr[-2000:]
    got = layout(work / "rep" / "report.html", work)
    assert not got["console"], got["console"]
    assert got["font"], "the embedded font did not load"
    assert got["data"], "the page's JSON does not parse"
    drawn = {c["id"]: c for c in got["charts"]}
    for ident in charts:
        assert ident in drawn, (ident, sorted(drawn))
        c = drawn[ident]
        assert c["w"] > 150 and c["h"] > 60 and c["series"] >= 1 and c["labels"], c
    assert not got["overlaps"], got["overlaps"][:10]
    names = {s["name"] for s in json.loads(run_cli("stacks", "--warehouse", str(wh), "--json").stdout)["stacks"]}
    labels = {t for c in got["charts"] for t in c["labels"]}
    assert not any("@" in t for t in labels), labels  # no cell ids on a chart
    measured = {n for n in names if n in labels}
    assert len(measured) >= len(names) - 1, (names, labels)  # every stack but a reference has a label
    return got


MODEL_CHARTS = ["kld-summary-{k}", "kld-cdf-{k}", "kld-position-{k}", "top1-{k}", "centroid-{k}", "pairwise-js-{k}"]


@needs_chromium
def test_report_renders_in_headless_chromium(swept, tmp_path):
    _, wh, _, _ = swept
    d = tmp_path / "wh"
    shutil.copytree(wh, d)
    assert run_cli("analyze", "--warehouse", str(d)).returncode == 0
    got = check_report(d, tmp_path, [c.format(k=0) for c in MODEL_CHARTS])
    charts = {c["id"]: c for c in got["charts"]}
    assert (
        charts["kld-position-0"]["series"] == 3 and charts["kld-cdf-0"]["series"] == 3
    )  # the stacks but the reference
    assert {"hf/fp32/eager", "hf/fp32/sdpa", "hf/bf16/sdpa"} <= set(charts["pairwise-js-0"]["labels"])
    shot = tmp_path / "shot.png"
    s = subprocess.run(
        [
            CHROMIUM,
            *FLAGS,
            f"--user-data-dir={tmp_path / 'u2'}",
            "--window-size=1200,2000",
            f"--screenshot={shot}",
            (tmp_path / "rep" / "report.html").as_uri(),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert s.returncode == 0 and shot.stat().st_size > 20_000  # a page with plots, not a blank one


@needs_chromium
def test_the_demo_warehouse_report(tmp_path):
    """configs/smoke.yaml's 17 stacks of four engines, layer states, a decode path, a prefix-cache
    check and batch cells, on 64-token prefixes where the demo reads 768 and with one repeat where
    it takes two: the same charts and labels (the decode path and the prefix-cache check read each
    whole prompt whatever the prefix; no chart draws a second repeat) for a 24th of the bf16
    work, which a CPU without native bf16 emulates."""
    spec = yaml.safe_load((REPO / "configs" / "smoke.yaml").read_text())
    (tmp_path / "smoke.yaml").write_text(yaml.safe_dump({**spec, "max_tokens": 64, "repeats": 1}, sort_keys=False))
    wh = tmp_path / "wh"
    r = run_cli("run", str(tmp_path / "smoke.yaml"), "--warehouse", str(wh), timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    extra = ["layers-cosine", "layers-norm-ratio", "prefill-decode", "batch-0"]
    got = check_report(wh, tmp_path, [c.format(k=0) for c in MODEL_CHARTS] + extra)
    charts = {c["id"]: c for c in got["charts"]}
    stacks = sql(wh, "select count(*) as n from summary where not is_reference")[0]["n"]
    assert charts["kld-summary-0"]["series"] == 2 and charts["kld-cdf-0"]["series"] >= stacks - 1
    # the two MLX q8 stacks differ only in fp32 activations, and their labels say so
    assert {"mlx/q8_g64", "mlx/q8_g64/activations=fp32"} <= set(charts["top1-0"]["labels"])
    page = (tmp_path / "rep" / "report.html").read_text()
    assert "mean_prob: the normalised mean of the stacks' probabilities" in page
    assert 'id="runs"' in page and 'id="hosts"' in page and 'id="engines"' in page


@needs_chromium
def test_the_layout_probe_sees_overlapping_labels(tmp_path):
    """The probe itself: two labels drawn over each other are reported, two apart are not."""
    from analysis.report_plots import font_face

    page = tmp_path / "p.html"
    page.write_text(
        f"<!doctype html><html><head><style>{font_face()}</style></head><body>"
        '<svg class="chart" id="a" width="300" height="80"><g id="a-series-0"><text x="10" y="20" '
        'style="font: 9px \'DejaVu Sans\'">hf/fp32/eager</text><text x="40" y="24" '
        'style="font: 9px \'DejaVu Sans\'">llamacpp/q4_k_m</text><text x="10" y="60" '
        "style=\"font: 9px 'DejaVu Sans'\">apart</text></g></svg></body></html>"
    )
    got = layout(page, tmp_path)
    assert got["font"] and [o[1:4:2] for o in got["overlaps"]] == [["hf/fp32/eager", "llamacpp/q4_k_m"]], got
    assert got["charts"][0]["series"] == 1 and got["charts"][0]["labels"] == [
        "hf/fp32/eager",
        "llamacpp/q4_k_m",
        "apart",
    ]
