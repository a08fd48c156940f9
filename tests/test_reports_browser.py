"""The HTML reports as a person sees them: Debian's `chromium`, driven by playwright, opens
each report offline (every request but file:// aborted); no console errors, no page errors,
no failed requests, every plotly figure drawn. Reports come from small simulator runs."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

sync_api = pytest.importorskip("playwright.sync_api",
                               reason="needs playwright (pip install playwright)")
CHROMIUM = os.environ.get("KESTREL_CHROMIUM") or shutil.which("chromium")
if not CHROMIUM:
    pytest.skip("needs a chromium binary (apt-get install chromium, or set KESTREL_CHROMIUM)",
                allow_module_level=True)

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--set", "workload.requests=40"]
REPORTS = ["run/report.html", "sweep/sweep.html", "validate/summary.html",
           "validate/spec-k4-fused/parity.html"]  # one of each kind
UNDRAWN = """Array.from(document.querySelectorAll('.plotly-graph-div'))
                  .filter(div => !div.querySelector('.main-svg')).length"""


def kestrel(*args, codes=(0,)) -> None:
    """Run the `kestrel` CLI in a fresh process; it exits with one of `codes`."""
    done = subprocess.run([sys.executable, "-m", "kestrel_cli.app", *map(str, args)],
                          check=False, cwd=ROOT, capture_output=True, text=True)
    assert done.returncode in codes, f"kestrel {' '.join(map(str, args))}:\n{done.stderr}"


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reports")
    kestrel("run", "scenarios/default.yaml", "--out", out / "run", *SMALL)
    kestrel("sweep", "scenarios/default.yaml", "--out", out / "sweep", *SMALL,
            "--set", "spec.k=1,4", "--set", "workload.arrivals.rate=5,20")
    # exit 1 where a kept run falls past its tolerance: the reports are written all the same
    kestrel("validate", "scenarios/validation", "--out", out / "validate",
            "--measured", "bench/results/validation/measured.json.gz",
            "--only", "spec-k4-fused,int4", codes=(0, 1))
    return out


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM)
        yield browser
        browser.close()


def offline_only(route) -> None:
    if route.request.url.startswith("file:"):
        route.continue_()
    else:
        route.abort()


def open_offline(browser, path: Path) -> dict:
    """Open `path` with the network blocked: what went wrong, and the plotly figures drawn."""
    page = browser.new_page()
    seen = {"error": [], "warning": [], "page errors": [], "failed requests": []}
    page.on("console", lambda m: seen[m.type].append(m.text) if m.type in seen else None)
    page.on("pageerror", lambda e: seen["page errors"].append(str(e)))
    page.on("requestfailed", lambda r: seen["failed requests"].append(r.url))
    page.route("**/*", offline_only)
    page.goto(path.resolve().as_uri(), wait_until="load")
    seen["figures"] = page.locator(".plotly-graph-div").count()
    seen["undrawn"] = page.evaluate(UNDRAWN)
    page.close()
    return seen


@pytest.mark.parametrize("name", REPORTS)
def test_report_opens_offline_without_errors(reports, browser, name):
    seen = open_offline(browser, reports / name)
    for text in seen["warning"]:
        warnings.warn(f"{name}: console warning: {text}", stacklevel=1)
    assert seen["error"] == [] and seen["page errors"] == [], seen
    assert seen["failed requests"] == [], f"{name} asks the network for {seen['failed requests']}"
    assert seen["figures"] > 0 and seen["undrawn"] == 0, seen


def test_the_check_sees_a_page_that_needs_the_network(tmp_path, browser):
    page = tmp_path / "cdn.html"
    page.write_text("<!DOCTYPE html><script src='https://cdn.plot.ly/plotly.min.js'></script>"
                    "<div class='plotly-graph-div'></div><script>Plotly.newPlot('x', [])"
                    "</script>")
    seen = open_offline(browser, page)
    assert seen["failed requests"] == ["https://cdn.plot.ly/plotly.min.js"]
    assert seen["page errors"] == ["Plotly is not defined"] and seen["undrawn"] == 1
