"""The asv dashboard: ``asv publish`` builds it from the results kept in asv_bench/results/,
a local server on 127.0.0.1 serves it, and headless Chromium renders it; the test checks that
the benchmark graphs were drawn and leaves screenshots (PNG) for a person to look at.

Skipped, with the reason, where asv or Chromium is missing (Debian: ``apt-get install -y
chromium``) or no results are kept yet. Set FLASHCORE_DASHBOARD_OUT=DIR to keep the
screenshots there.
"""
from __future__ import annotations

import functools
import glob
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ASV_DIR = ROOT / "asv_bench"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update",
                  "--disable-sync", "--hide-scrollbars", "--window-size=1400,1000",
                  "--virtual-time-budget=15000"]
#: the graph page the test opens (one kept for the CPU machine)
GRAPH = "bench_attention.ForwardCPU.time_attention"


def _chromium():
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _result_files():
    return [p for p in glob.glob(str(ASV_DIR / "results" / "*" / "*.json"))
            if not p.endswith("machine.json")]


pytestmark = [
    pytest.mark.skipif(not _result_files(), reason="no asv results kept in asv_bench/results"),
    pytest.mark.skipif(_chromium() is None,
                       reason="Chromium is not installed (Debian: apt-get install -y chromium)"),
]


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory):
    pytest.importorskip("asv", reason="asv is not installed (pip install 'flashcore[bench]')")
    out = tmp_path_factory.mktemp("asv-html")
    p = subprocess.run([sys.executable, "-m", "asv", "publish", "--no-pull", "-o", str(out)],
                       cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (out / "index.html").exists()
    return out


@pytest.fixture(scope="module")
def server(html_dir):
    handler = functools.partial(_QuietHandler, directory=str(html_dir))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _browse(url, tmp_path, name):
    """(DOM after scripts ran, screenshot path) of ``url`` in headless Chromium."""
    profile = tmp_path / f"profile-{name}"
    shot = tmp_path / f"{name}.png"
    base = [_chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}"]
    dom = subprocess.run([*base, "--dump-dom", url], capture_output=True, text=True,
                         timeout=120)
    assert dom.returncode == 0, dom.stderr[-2000:]
    p = subprocess.run([*base, f"--screenshot={shot}", url], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 0 and shot.exists(), p.stderr[-2000:]
    keep = os.environ.get("FLASHCORE_DASHBOARD_OUT")
    if keep:
        os.makedirs(keep, exist_ok=True)
        shutil.copy(shot, Path(keep) / shot.name)
    return dom.stdout, shot


def _colourful_pixels(png):
    """How many pixels of the screenshot are neither white nor grey (plotted data)."""
    import numpy as np

    mpl_image = pytest.importorskip("matplotlib.image")
    img = mpl_image.imread(png)[..., :3]
    spread = img.max(axis=-1) - img.min(axis=-1)
    return int(np.count_nonzero(spread > 0.2))


def test_published_dashboard_lists_the_benchmarks(html_dir):
    index = json.loads((html_dir / "index.json").read_text())
    names = set(index["benchmarks"])
    assert GRAPH in names
    assert "bench_attention.ForwardBackwardCPU.time_attention" in names
    assert any(n.endswith("peakmem_attention") for n in names)
    assert any(n.endswith("track_extra_host_mib") for n in names)
    assert (html_dir / "graphs").is_dir()


def test_summary_page_renders_graphs(server, tmp_path):
    dom, shot = _browse(server + "/", tmp_path, "asv-summary")
    assert "flashcore" in dom
    assert GRAPH in dom  # the grid links every benchmark
    assert shot.stat().st_size > 10_000


def test_benchmark_graph_renders(server, tmp_path):
    dom, shot = _browse(f"{server}/#{GRAPH}", tmp_path, "asv-graph")
    # flot draws each graph on canvases inside the plot container; no canvas, no graph
    assert 'class="flot-base"' in dom, dom[:2000]
    assert "flot-overlay" in dom
    assert _colourful_pixels(shot) > 500  # the plotted series, in colour
