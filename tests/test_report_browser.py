"""The HTML report in headless Chromium (Debian `chromium`; .ci/run installs it): renders, plots present, no console errors."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import run_cli

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-logging=stderr", "--v=0"]


def rendered(page: Path, profile: Path) -> tuple[str, list[str]]:
    """(the DOM Chromium renders from a report page, its console lines); without Chromium
    (.ci/run installs it) the page as written and no console."""
    if CHROMIUM is None:
        return page.read_text(), []
    out = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout, [ln for ln in out.stderr.splitlines() if "CONSOLE" in ln]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(swept, tmp_path):
    _, wh, _, _ = swept
    assert run_cli("analyze", "--warehouse", str(wh)).returncode == 0
    r = run_cli("report", "--warehouse", str(wh), "--out", str(tmp_path / "rep"))
    assert r.returncode == 0, r.stderr
    url = (tmp_path / "rep" / "report.html").as_uri()
    dom = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'u1'}", "--dump-dom", url],
                         capture_output=True, text=True, timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    for ident in ("kld-position", "pairwise-js", "top1", "centroid"):
        assert f'id="{ident}"' in dom.stdout
    assert dom.stdout.count("<polyline") >= 3 and dom.stdout.count("<rect") >= 16
    console = [ln for ln in dom.stderr.splitlines() if "CONSOLE" in ln]
    assert not console, console
    shot = tmp_path / "shot.png"
    s = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path / 'u2'}", "--window-size=1200,2000",
                        f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    assert s.returncode == 0 and shot.stat().st_size > 20_000  # a page with plots, not a blank one
