"""``python -m flashcore warmup`` (numba_cuda's kernels compiled ahead, in parallel
processes, with progress) and the one-line notice a first compile logs. Without a GPU the
command runs under numba's CUDA simulator (where a "compile" only wraps the kernel), and the
notice is checked with a build that stands in for a slow compile."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import pytest

from flashcore import _warmup

pytest.importorskip("numba.cuda", reason="numba-cuda is not installed")


def _run(*args, sim=True):
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1" if sim else "0")
    return subprocess.run([sys.executable, "-m", "flashcore", "warmup", *args], env=env,
                          capture_output=True, text=True, timeout=300)


def test_warmup_compiles_each_job_with_progress_under_the_simulator():
    p = _run("--head-dims", "32", "--dtypes", "float32,bfloat16", "--processes", "2")
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    assert lines[0].startswith("flashcore warmup: 2 jobs (head dims 32; float32,bfloat16; "
                               "causal both) on GPU 0 in 2 processes")
    progress = sorted(line.split("/2 ", 1)[1].split(":")[0] for line in lines[1:3])
    assert progress == ["D=32 causal", "D=32 full"]
    assert "] 2/2 " in lines[2] and lines[-1].startswith("flashcore warmup: done in")


def test_jobs_cover_what_was_asked():
    assert _warmup.jobs((64, 128), ("float16",), "true") == [
        (64, True, ("float16",)), (128, True, ("float16",))]
    assert [j[:2] for j in _warmup.jobs((64,), _warmup.DTYPES, "both")] == [
        (64, False), (64, True)]


@pytest.mark.parametrize("args,needle", [
    (["--head-dims", "64,999"], "--head-dims must lie in 1..256; got 999"),
    (["--head-dims", "sixty"], "--head-dims must be integers separated by commas; got 'sixty'"),
    (["--dtypes", "float64"], "--dtypes must be among float32,float16,bfloat16"),
    (["--causal", "maybe"], "invalid choice: 'maybe'"),
])
def test_bad_options_name_the_argument_and_value(args, needle, capsys):
    with pytest.raises(SystemExit):
        _warmup.run_warmup(args)
    assert needle in capsys.readouterr().err


def test_without_a_gpu_it_says_why(monkeypatch, capsys):
    from flashcore import _dispatch

    monkeypatch.setattr(_dispatch, "unavailable_reason", lambda name: "no CUDA GPU found")
    assert _warmup.run_warmup([]) == 2
    assert "numba_cuda cannot run here: no CUDA GPU found" in capsys.readouterr().err


def test_a_slow_first_build_logs_one_line_once(monkeypatch, caplog):
    from flashcore.backends.numba_cuda import driver

    monkeypatch.setattr(driver, "NOTICE_AFTER_S", 0.05)
    monkeypatch.setattr(driver, "_noticed", False)
    with caplog.at_level(logging.WARNING, logger="flashcore"):
        with driver.compile_notice("attn_forward_d64", 0):
            pass  # a cache load: quicker than the threshold, nothing said
        assert caplog.records == []
        for name in ("attn_forward_d64", "attn_backward_dq_d64"):
            with driver.compile_notice(name, 1):
                time.sleep(0.2)  # a compile
    (record,) = caplog.records
    text = record.getMessage()
    assert "compiling CUDA kernel attn_forward_d64 for GPU 1" in text
    assert "cached in" in text and "python -m flashcore warmup" in text


def test_the_notice_names_numba_cache_dir(monkeypatch):
    from flashcore.backends.numba_cuda import driver
    from numba.core import config

    monkeypatch.setattr(config, "CACHE_DIR", "/tmp/kernels")
    assert driver.cache_location() == "NUMBA_CACHE_DIR=/tmp/kernels"
