"""``python -m flashcore`` (the main job), ``info``, and the errors a user can trigger.
Small sizes, no timing assertions."""
from __future__ import annotations

import shutil
import subprocess
import sys

import numpy as np
import pytest

import flashcore
from flashcore import _cli, bench
from flashcore._errors import BackendUnavailableError


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flashcore", *args], capture_output=True,
                          text=True, timeout=timeout)


SMALL = ["--seqlen", "96", "--heads", "2", "--head-dim", "16", "--repeat", "3"]


def test_main_job_in_a_subprocess_prints_check_time_flops_and_memory():
    p = run_cli(*SMALL, "--backend", "reference")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "attention forward, B=1 H=2 N=96 D=16 float32 non-causal" in out
    assert "backend: reference on numpy arrays" in out
    assert "check against the float64 reference" in out and "ok" in out
    for needle in ("time (median)", "GFLOP/s", "peak extra memory", "flashcore reference",
                   "naive numpy", "than naive"):
        assert needle in out, needle


def test_main_job_on_the_best_backend_here():
    p = run_cli(*SMALL, "--causal")
    assert p.returncode == 0, p.stdout + p.stderr
    assert "causal" in p.stdout and "ok" in p.stdout


@pytest.mark.parametrize("dtype", ["float64", "bfloat16", "float16"])
def test_main_job_dtypes_in_process(dtype, capsys):
    rc = _cli.main([*SMALL, "--dtype", dtype, "--backend", "reference", "--causal",
                    "--no-naive"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert f"{dtype} causal" in out and "naive" not in out.split("peak extra memory")[1]


def test_main_job_checks_batches_and_uneven_sizes(capsys):
    rc = _cli.main(["--batch", "2", "--heads", "3", "--seqlen", "70", "--head-dim", "5",
                    "--backend", "reference", "--repeat", "3"])
    assert rc == 0, capsys.readouterr().out


def test_the_check_catches_a_wrong_output():
    config = bench.Config(batch=1, heads=2, seqlen=100, head_dim=8, causal=True)
    q, k, v = bench.host_inputs(config)[:3]
    o, lse = flashcore.attention_forward(q, k, v, causal=True, backend="reference")
    check = _cli.check_against_reference(config, "numpy", seed=0)
    good = check((o, lse))
    assert good["ok"] and good["rel_err"] < 1e-6
    bad_o = o.copy()
    bad_o[0, 1, -1, 3] += 1.0  # one element of the last row of the last head
    assert not check((bad_o, lse))["ok"]
    bad_o = o.copy()
    bad_o[0, 0, 5, 0] = np.nan  # a NaN in the first rows
    assert not check((bad_o, lse))["ok"]
    assert not check((o, lse + 1))["ok"]


def test_the_checked_slices_keep_the_causal_alignment():
    config = bench.Config(heads=3, seqlen=200, head_dim=4, causal=True)
    slices = _cli._slices(config)
    assert {(h, r.start, r.stop, nk) for _, h, r, nk in slices} == {
        (0, 0, 64, 64), (0, 136, 200, 200), (2, 0, 64, 64), (2, 136, 200, 200)}
    short = bench.Config(heads=1, seqlen=10, head_dim=4)
    assert [(r.start, r.stop, nk) for _, _, r, nk in _cli._slices(short)] == [(0, 10, 10)]


def test_choose_backend_follows_the_auto_order_and_explains():
    name, library, device, notes = _cli.choose_backend("auto", bench.Config())
    assert name in flashcore.available_backends()
    assert flashcore.available_backends()[name] is None
    assert (library, device) == _cli._backend_target(name)
    assert _cli.choose_backend("reference", bench.Config())[:3] == ("reference", "numpy", "cpu")


def test_a_named_backend_that_cannot_run_is_a_clear_error():
    unavailable = [n for n, why in flashcore.available_backends().items() if why is not None]
    if not unavailable:
        pytest.skip("every backend can run here")
    name = unavailable[0]
    with pytest.raises(BackendUnavailableError, match=f"backend '{name}' cannot run here"):
        _cli.choose_backend(name, bench.Config())
    p = run_cli(*SMALL, "--backend", name)
    assert p.returncode == 2
    assert f"backend '{name}' cannot run here" in p.stderr


def test_info_lists_backends_devices_and_versions():
    p = run_cli("info")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert f"flashcore {flashcore.__version__}" in out
    assert "numpy " in out and "numba " in out
    assert "devices:" in out and "cpu" in out
    for name, why in flashcore.available_backends().items():
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name + " "))
        assert ("usable" in line) == (why is None), line


@pytest.mark.parametrize("args, needle", [
    (["--seqlen", "-3"], "argument --seqlen: expected a positive integer, got '-3'"),
    (["--heads", "two"], "argument --heads: expected a positive integer, got 'two'"),
    (["--batch", "0"], "argument --batch: expected a positive integer, got '0'"),
    (["--head-dim", "300"], "argument --head-dim: head dim must be between 1 and 256, got '300'"),
    (["--dtype", "int8"], "argument --dtype: invalid choice: 'int8'"),
    (["--backend", "cuda_magic"], "argument --backend: invalid choice: 'cuda_magic'"),
    (["--repeat", "1.5"], "argument --repeat: expected a positive integer, got '1.5'"),
    (["--frobnicate"], "unrecognized arguments: --frobnicate"),
], ids=["seqlen", "heads", "batch", "head-dim", "dtype", "backend", "repeat", "unknown"])
def test_bad_options_get_clear_messages(args, needle, capsys):
    with pytest.raises(SystemExit) as e:
        _cli.main(args)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_an_unknown_command_is_named():
    p = run_cli("benchmark")
    assert p.returncode == 2
    assert "unknown command 'benchmark'" in p.stderr and "info, bench" in p.stderr


def test_help_mentions_the_subcommands():
    p = run_cli("--help")
    assert p.returncode == 0
    assert "info" in p.stdout and "bench" in p.stdout and "--seqlen" in p.stdout


def test_main_function_is_the_script_entry_point(capsys):
    from flashcore.__main__ import main

    assert main(["info"]) == 0
    assert "backends" in capsys.readouterr().out


@pytest.mark.skipif(shutil.which("flashcore") is None, reason="the flashcore script is not on PATH")
def test_console_script():
    p = subprocess.run(["flashcore", "info"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "backends" in p.stdout
