"""The asv dashboard: ``asv publish`` builds it from the results kept in asv_bench/results/,
a local server on 127.0.0.1 serves it, and headless Chromium renders it; the test checks that
the benchmark graphs were drawn and leaves screenshots (PNG) for a person to look at.

The published page loads jQuery, flot, bootstrap, stupidtable and md5 from CDNs; this test
never leaves 127.0.0.1, so it points those URLs at Debian's packaged copies instead
(``apt-get install -y chromium libjs-jquery libjs-jquery-flot libjs-bootstrap
libjs-jquery-stupidtable node-blueimp-md5``) and skips, saying so, where they are missing, as
it does without asv, Chromium or kept results. Set FLASHCORE_DASHBOARD_OUT=DIR to keep the
screenshots there.
"""
from __future__ import annotations

import functools
import glob
import http.server
import json
import os
import re
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
#: the graph page the test opens (one kept for the CPU machine), and one kept for the H200
GRAPH = "bench_attention.ForwardCPU.time_attention"
GPU_GRAPH = "bench_attention.ForwardBackwardGPU.time_attention"


JS = Path("/usr/share/javascript")
#: CDN file name in asv's page -> Debian's copy (None: served empty; orderBars only draws
#: bar charts, which this suite does not use)
LOCAL_COPIES = {
    "jquery-3.3.1.min.js": JS / "jquery/jquery.min.js",
    "jquery.flot.min.js": JS / "jquery-flot/jquery.flot.js",
    "jquery.flot.time.min.js": JS / "jquery-flot/jquery.flot.time.js",
    "jquery.flot.selection.min.js": JS / "jquery-flot/jquery.flot.selection.js",
    "jquery.flot.categories.min.js": JS / "jquery-flot/jquery.flot.categories.js",
    "jquery.flot.orderBars.js": None,
    "stupidtable.min.js": JS / "jquery-stupidtable/stupidtable.min.js",
    "md5.min.js": JS / "blueimp-md5/md5.min.js",
    "bootstrap.min.js": JS / "bootstrap/js/bootstrap.min.js",
    "bootstrap.min.css": JS / "bootstrap/css/bootstrap.min.css",
}


#: Debian's flot (4.x) draws the legend in SVG and leaves its background to the page's CSS
LEGEND_CSS = ("<style>.legendLayer .background { fill: rgba(255, 255, 255, 0.85); "
              "stroke: rgba(0, 0, 0, 0.85); stroke-width: 1; }</style>")


def _missing_local_copies():
    return [str(p) for p in LOCAL_COPIES.values() if p is not None and not p.exists()]


def _use_local_copies(html_dir: Path):
    """Point the CDN scripts and styles of every published page at local copies (links
    that a person would click are left alone)."""
    vendor = html_dir / "vendor"
    vendor.mkdir(exist_ok=True)
    for name, src in LOCAL_COPIES.items():
        (vendor / name).write_bytes(src.read_bytes() if src is not None else b"")

    def local(m):
        name = m.group(2).rsplit("/", 1)[-1]
        if name not in LOCAL_COPIES:
            raise AssertionError(f"the page loads {m.group(2)}, which has no local copy")
        return f'{m.group(1)}="vendor/{name}"'

    for page in html_dir.glob("*.html"):
        text = page.read_text()
        text = re.sub(r'(<script[^>]*\ssrc|<link[^>]*\shref)="(https?://[^"]+)"', local, text)
        text = re.sub(r'\s(integrity|crossorigin|referrerpolicy)="[^"]*"', "", text)
        text = text.replace("</head>", LEGEND_CSS + "</head>", 1)
        page.write_text(text)


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
    pytest.mark.skipif(bool(_missing_local_copies()),
                       reason="local copies of the dashboard's scripts are missing: "
                              f"{_missing_local_copies()} (see the module docstring)"),
]


@pytest.fixture(scope="module")
def html_dir(tmp_path_factory):
    pytest.importorskip("asv", reason="asv is not installed (pip install 'flashcore[bench]')")
    out = tmp_path_factory.mktemp("asv-html")
    p = subprocess.run([sys.executable, "-m", "asv", "publish", "--no-pull", "-o", str(out)],
                       cwd=ASV_DIR, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (out / "index.html").exists()
    _use_local_copies(out)
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
    # both machines have history: the 2-core CPU machine and the H200 (GPU benchmarks)
    machines = {p.name for p in (html_dir / "graphs").rglob("machine-*")}
    assert {"machine-cpu-2core", "machine-h200"} <= machines, machines
    gpu = [p for p in (html_dir / "graphs").rglob(f"{GPU_GRAPH}.json")
           if "machine-h200" in p.parts]
    assert gpu, "no H200 graph for the GPU benchmarks"
    series = json.loads(gpu[0].read_text())
    assert len(series) >= 3, series  # one point per recorded commit


def test_summary_page_renders_graphs(server, tmp_path):
    dom, shot = _browse(server + "/", tmp_path, "asv-summary")
    assert "flashcore" in dom
    assert GRAPH in dom  # the grid links every benchmark
    assert shot.stat().st_size > 10_000


@pytest.mark.parametrize("graph", [GRAPH, GPU_GRAPH], ids=["cpu", "h200"])
def test_benchmark_graph_renders(server, tmp_path, graph):
    dom, shot = _browse(f"{server}/#{graph}", tmp_path, f"asv-graph-{graph.split('.')[1]}")
    # flot draws each graph on canvases inside the plot container; no canvas, no graph
    assert 'class="flot-base"' in dom, dom[:2000]
    assert "flot-overlay" in dom
    assert _colourful_pixels(shot) > 500  # the plotted series, in colour
