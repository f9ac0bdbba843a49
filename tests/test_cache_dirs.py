"""Numba's disk cache of flashcore's kernels: where it goes when flashcore is installed into
a read-only site-packages, and how numba-cuda keys it by the GPU's compute capability.

The read-only install is a copy of the package laid out as pip installs it
(``flashcore/`` with ``backends/`` as ``flashcore/backends/``), made read-only, imported by a
subprocess whose HOME is a temporary directory and with no ``NUMBA_CACHE_DIR``. Run as root,
the subprocess drops CAP_DAC_OVERRIDE first, or it could write anywhere; where even that is
not possible (or the directory stays writable) the tests skip.
"""
from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import types as pytypes

import pytest

_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH, _PR_CAPBSET_DROP = 1, 2, 24


def _drop_dac_override():
    """(In the child, before exec.) Root without these capabilities obeys file modes."""
    if os.geteuid() == 0:
        libc = ctypes.CDLL(None, use_errno=True)
        for cap in (_CAP_DAC_OVERRIDE, _CAP_DAC_READ_SEARCH):
            if libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
                raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def _set_writable(root, writable):
    for d, _, files in os.walk(root):
        for p in [d] + [os.path.join(d, f) for f in files]:
            mode = os.lstat(p).st_mode
            if not stat.S_ISLNK(mode):
                os.chmod(p, mode | stat.S_IWUSR if writable else
                         mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@pytest.fixture
def read_only_install(tmp_path):
    """``(site, home, tmp)``: flashcore copied into ``site`` (read-only), an empty HOME and
    an empty TMPDIR."""
    import flashcore.backends  # (binds flashcore too)

    site = tmp_path / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(flashcore.__path__[0], site / "flashcore", ignore=ignore)
    shutil.rmtree(site / "flashcore" / "backends", ignore_errors=True)
    shutil.copytree(flashcore.backends.__path__[0], site / "flashcore" / "backends",
                    ignore=ignore)
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir()
    tmp.mkdir()
    _set_writable(site, False)
    yield site, home, tmp
    _set_writable(tmp_path, True)


#: Reported first by every child: whether it could write into the installed package.
_PROBE = """
import json, os, sys, tempfile
pkg = os.path.join(sys.argv[1], "flashcore", "backends", "numba_cpu")
try:
    tempfile.TemporaryFile(dir=pkg).close()
    writable = True
except OSError:
    writable = False
print(json.dumps({"package_writable": writable}), flush=True)
import flashcore
assert flashcore.__file__.startswith(sys.argv[1]), flashcore.__file__
"""


def _child(body, site, home, tmp, timeout=600):
    """Run ``_PROBE + body`` as a read-only install's user; the JSON lines it printed."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME", "PYTHONPATH")}
    env.update(HOME=str(home), TMPDIR=str(tmp), PYTHONPATH=str(site),
               PYTHONDONTWRITEBYTECODE="1")
    script = tmp.parent / "child.py"
    script.write_text(_PROBE + textwrap.dedent(body))
    try:
        r = subprocess.run([sys.executable, str(script), str(site)], cwd=tmp, env=env,
                           capture_output=True, text=True, timeout=timeout,
                           preexec_fn=_drop_dac_override)
    except (OSError, subprocess.SubprocessError) as e:
        if "prctl" in str(e):
            pytest.skip(f"cannot drop root's CAP_DAC_OVERRIDE here: {e}")
        raise
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    if lines and lines[0]["package_writable"]:
        pytest.skip("cannot make a directory read-only for this user here")
    assert r.returncode == 0, r.stderr[-3000:]
    return lines[1:]


#: The child's report on flashcore's cache=True CPU kernels, after the front end loaded
#: the backend (as a first call does) and the kernel modules were imported (defining a
#: cache=True function is where numba picks its cache directory).
_CACHED = """
import importlib, pkgutil
import flashcore.backends.numba_cpu as cpu
from flashcore import _dispatch
_dispatch.load("numba_cpu")


def cached_kernels():
    "Every cache=True dispatcher of the numba_cpu package's modules."
    found = {}
    for m in pkgutil.iter_modules(cpu.__path__):
        mod = importlib.import_module(f"{cpu.__name__}.{m.name}")
        for f in vars(mod).values():
            if type(getattr(f, "_cache", None)).__name__ not in ("NoneType", "NullCache"):
                found[f.__name__] = f
    return list(found.values())
"""

_LOCATE = _CACHED + """
for f in cached_kernels():
    print(json.dumps({"name": f.__name__, "cache": f._cache._cache_path}))
"""


def _inside(path, root):
    return os.path.realpath(path).startswith(os.path.realpath(root) + os.sep)


def test_read_only_install_caches_in_the_user_cache_dir(read_only_install):
    """numba's own fallback: __pycache__ is not writable, so ~/.cache/numba is used."""
    site, home, tmp = read_only_install
    found = _child(_LOCATE, site, home, tmp)
    assert len(found) >= 4, found  # forward, preprocess, dK/dV, dQ, split merge
    for f in found:
        assert _inside(f["cache"], home / ".cache" / "numba"), f
        assert os.path.isdir(f["cache"]), f


def test_read_only_install_and_home_use_flashcores_fallback(read_only_install):
    """HOME not writable either (a container user with HOME=/): without flashcore's
    fallback numba raises 'no locator available' when the kernels are defined."""
    from flashcore import _numba_cache

    site, home, tmp = read_only_install
    home.chmod(0o555)
    found = _child(_LOCATE, site, home, tmp)
    fallback = os.path.join(str(tmp), os.path.basename(_numba_cache.fallback_dir()))
    assert len(found) >= 4, found
    for f in found:
        assert _inside(f["cache"], fallback), f
        assert os.path.isdir(f["cache"]), f
    assert stat.S_IMODE(os.stat(fallback).st_mode) == 0o700


def test_fallback_refuses_a_directory_others_may_write(tmp_path, monkeypatch):
    """Numba's cache files are pickles: a fallback directory someone else could have
    filled is not used."""
    from flashcore import _numba_cache

    monkeypatch.setattr(_numba_cache.tempfile, "gettempdir", lambda: str(tmp_path))
    d = _numba_cache.fallback_dir()
    assert _numba_cache._private(d)
    os.chmod(d, 0o777)
    assert not _numba_cache._private(d)


#: Computes delta = rowsum(dO * O) with a cache=True kernel of the read-only install (the
#: cheapest one to compile), then reports numba's cache statistics.
_PREPROCESS = """
import numpy as np
from flashcore import _dispatch
_dispatch.load("numba_cpu")
from flashcore.backends.numba_cpu.backward_kernels import attn_backward_preprocess as f
x = np.ones((1, 2, 8, 4), np.float32)
delta = np.zeros((1, 2, 8), np.float32)
f(x, x, delta, np.dtype(np.float32))
assert (delta == 4).all()
print(json.dumps({"hits": sum(f.stats.cache_hits.values()),
                  "misses": sum(f.stats.cache_misses.values()),
                  "cache": f._cache._cache_path}))
"""


@pytest.mark.parametrize("home_writable", [
    pytest.param(True, id="home"),
    pytest.param(False, id="read-only-home", marks=pytest.mark.slow),  # (~10 s more)
])
def test_read_only_install_reuses_its_cache(read_only_install, home_writable):
    """A second process loads what the first compiled (numba's cache hit counters): in the
    user cache dir, or in flashcore's fallback."""
    site, home, tmp = read_only_install
    if not home_writable:
        home.chmod(0o555)
    (first,) = _child(_PREPROCESS, site, home, tmp)
    (second,) = _child(_PREPROCESS, site, home, tmp)
    assert (first["misses"], first["hits"]) == (1, 0), first
    assert (second["misses"], second["hits"]) == (0, 1), second
    assert any(n.endswith(".nbi") for n in os.listdir(first["cache"]))


_ATTENTION = _CACHED + """
import time
import numpy as np
t = time.perf_counter()
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, 2, 64, 32), dtype=np.float32) for _ in range(3))
o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="numba_cpu")
dq, dk, dv = flashcore.attention_backward(np.ones_like(o), q, k, v, o, lse, causal=True,
                                          backend="numba_cpu")
ref = flashcore.attention(q, k, v, causal=True, backend="reference")
assert np.allclose(o, ref, atol=1e-5)
fs = cached_kernels()
print(json.dumps({"seconds": time.perf_counter() - t,
                  "hits": sum(sum(f.stats.cache_hits.values()) for f in fs),
                  "misses": sum(sum(f.stats.cache_misses.values()) for f in fs)}))
"""


@pytest.mark.slow
def test_read_only_install_attention_round_trip(read_only_install):
    """The whole call: forward and backward compile in the first process (tens of
    seconds on a 2-core host) and load from the user cache dir in the second."""
    site, home, tmp = read_only_install
    (first,) = _child(_ATTENTION, site, home, tmp)
    (second,) = _child(_ATTENTION, site, home, tmp)
    assert first["misses"] >= 3 and first["hits"] == 0, first  # forward, dK/dV, dQ
    assert (second["misses"], second["hits"]) == (0, first["misses"]), second
    assert second["seconds"] < first["seconds"]


# --- numba-cuda: one cache entry per compute capability -----------------------------------


def _cuda_or_skip():
    if os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0"):
        pytest.skip("needs the real numba.cuda, not the CUDA simulator")
    cuda = pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")
    try:
        from numba.cuda import types

        cuda.compile_ptx(lambda x: None, (types.float32[:],), cc=(8, 0))
    except Exception as e:  # noqa: BLE001  (NVVM missing: the toolkit wheels are not installed)
        pytest.skip(f"the CUDA toolkit (NVVM) is not importable: {type(e).__name__}: {e}")
    return cuda


_KERNEL = """
from numba import cuda


def double(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] = x[i] * 2.0
"""


def test_cuda_cache_keeps_one_entry_per_compute_capability(tmp_path, monkeypatch):
    """Two GPUs of different architectures in one host (or one cache dir shared by hosts)
    do not overwrite each other's kernels: numba-cuda's index key is (signature,
    ``codegen.magic_tuple()`` = (CUDA runtime version, compute capability), numba-cuda's
    version, hashes of the bytecode and closure) (numba/cuda/core/caching.py
    ``Cache._index_key``, numba/cuda/codegen.py ``JITCUDACodegen.magic_tuple``). Shown
    without a GPU: the current device's compute capability is faked, and the cubin link
    (``_Kernel.bind``, the one step that needs the GPU) is skipped."""
    cuda = _cuda_or_skip()
    import numba.cuda.dispatcher as nd
    from numba.cuda import types
    from numba.cuda.cudadrv import devices

    (tmp_path / "kern.py").write_text(_KERNEL)
    spec = importlib.util.spec_from_file_location("kern", tmp_path / "kern.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(nd._Kernel, "bind", lambda self: None)
    sig = (types.float32[:],)

    def compile_on(cc):
        gpu = pytypes.SimpleNamespace(compute_capability=cc)
        monkeypatch.setattr(nd, "get_current_device", lambda: gpu)
        monkeypatch.setattr(devices, "get_context",
                            lambda *a, **k: pytypes.SimpleNamespace(device=gpu))
        disp = cuda.jit(mod.double, cache=True)  # a new dispatcher: reads the disk cache
        disp.compile(sig)
        index = disp._cache._cache_file._load_index()
        return disp, index

    d80, index = compile_on((8, 0))
    d90, index = compile_on((9, 0))
    assert (sum(d80.stats.cache_misses.values()), sum(d90.stats.cache_misses.values())) == (1, 1)
    ccs = sorted(key[1][1] for key in index)
    assert ccs == [(8, 0), (9, 0)], index.keys()
    assert len(set(index.values())) == 2  # two data files
    again, _ = compile_on((8, 0))
    assert sum(again.stats.cache_hits.values()) == 1
    assert sum(again.stats.cache_misses.values()) == 0
