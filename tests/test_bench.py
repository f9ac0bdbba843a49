"""The benchmark package (flashcore.bench) and ``python -m flashcore bench``: records and
their JSON schema, ratios, tables, plots, progress, memory and host-time measurement, and the
asv suite's loading of the package. Small sizes, no timing assertions."""
from __future__ import annotations

import io
import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import qkv

import flashcore
from flashcore import bench

HAS_TORCH = bench.has_module("torch")
HAS_MPL = bench.has_module("matplotlib")
TINY = bench.Config(batch=1, heads=2, seqlen=32, head_dim=8)


def run_cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "flashcore", *args], capture_output=True,
                          text=True, timeout=timeout)


# --- configs -----------------------------------------------------------------------------


def test_config_rejects_bad_sizes_naming_the_field():
    with pytest.raises(ValueError, match=r"seqlen must be a positive integer; got seqlen=0"):
        bench.Config(seqlen=0)
    with pytest.raises(ValueError, match=r"dtype='int8'"):
        bench.Config(dtype="int8")


def test_flops_and_bytes_follow_the_conventions():
    c = bench.Config(batch=2, heads=3, seqlen=16, head_dim=8)
    fwd = 4 * 2 * 3 * 16 * 16 * 8
    assert c.flops("fwd") == fwd
    assert c.flops("fwdbwd") == 3.5 * fwd
    assert bench.Config(2, 3, 16, 8, causal=True).flops("fwd") == fwd / 2
    # compulsory traffic: q, k, v in, o out (float32) plus float32 lse
    assert c.io_bytes("fwd") == 4 * (2 * 3 * 16 * 8) * 4 + 4 * 2 * 3 * 16
    assert c.io_bytes("fwd", materializes=True) > c.io_bytes("fwd")
    assert c.io_bytes("fwdbwd") > c.io_bytes("fwd")


def test_host_inputs_are_seeded_and_typed():
    a = bench.host_inputs(TINY, seed=3)
    b = bench.host_inputs(TINY, seed=3)
    c = bench.host_inputs(TINY, seed=4)
    assert len(a) == 4 and all(x.shape == TINY.shape and x.dtype == np.float32 for x in a)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])
    bf = bench.host_inputs(bench.Config(1, 1, 4, 4, "bfloat16"))
    assert bf[0].dtype.name == "bfloat16"


# --- the naive peer is right -------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_naive_numpy_matches_the_reference(causal):
    import array_api_compat

    rng = np.random.default_rng(1)
    q, k, v = (x.astype(np.float64) for x in qkv(rng, Hq=2, Nq=24, D=8))
    do = rng.standard_normal(q.shape)
    xp = array_api_compat.array_namespace(q)
    scale = 1 / np.sqrt(8)
    o, p = bench.naive_forward(xp, q, k, v, scale, causal)
    ro, rl = flashcore.attention_forward(q, k, v, causal=causal, backend="reference")
    np.testing.assert_allclose(o, ro, rtol=1e-10, atol=1e-12)
    grads = bench.naive_backward(xp, do, q, k, v, o, p, scale)
    ref = flashcore.attention_backward(do, q, k, v, ro, rl, causal=causal, backend="reference")
    for g, r in zip(grads, ref):  # the reference recomputes P from the float64 lse
        np.testing.assert_allclose(g, r, rtol=1e-10, atol=1e-12)


def test_naive_causal_mask_is_bottom_right_when_queries_and_keys_differ():
    import array_api_compat

    rng = np.random.default_rng(2)
    q, k, v = (x.astype(np.float64) for x in qkv(rng, Hq=2, Nq=5, Nk=9, D=8))
    xp = array_api_compat.array_namespace(q)
    o, p = bench.naive_forward(xp, q, k, v, 0.25, True)
    # query i sees key j iff j <= i + (Nk - Nq): row 0 sees keys 0..4
    assert np.all(p[..., 0, 5:] == 0) and np.all(p[..., 0, :5] > 0)
    ro, _ = flashcore.attention_forward(q, k, v, causal=True, scale=0.25, backend="reference")
    np.testing.assert_allclose(o, ro, rtol=1e-10, atol=1e-12)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
def test_naive_torch_matches_naive_numpy():
    import array_api_compat
    import torch

    q, k, v, do = bench.host_inputs(bench.Config(1, 2, 20, 8, "float64", True))
    npx = array_api_compat.array_namespace(q)
    o, p = bench.naive_forward(npx, q, k, v, 0.3, True)
    tq, tk, tv, tdo = (torch.from_numpy(x.copy()) for x in (q, k, v, do))
    tx = array_api_compat.array_namespace(tq)
    to, tp = bench.naive_forward(tx, tq, tk, tv, 0.3, True)
    np.testing.assert_allclose(to.numpy(), o, rtol=1e-12)
    for a, b in zip(bench.naive_backward(tx, tdo, tq, tk, tv, to, tp, 0.3),
                    bench.naive_backward(npx, do, q, k, v, o, p, 0.3)):
        np.testing.assert_allclose(a.numpy(), b, rtol=1e-10, atol=1e-12)


# --- measuring ---------------------------------------------------------------------------


def test_measure_returns_a_complete_record():
    rec = bench.measure(bench.get_contender("numpy_naive"), TINY, "fwdbwd", repeat=3)
    assert rec["error"] is None and rec["skipped"] is None
    assert len(rec["times_s"]) == 3 and rec["median_s"] > 0
    assert rec["gflops_per_s"] == pytest.approx(rec["flops"] / rec["median_s"] / 1e9)
    assert rec["kind"] == "peer" and rec["direction"] == "fwdbwd"
    assert rec["config"] == TINY.as_dict()


def test_measure_runs_the_check_on_the_warm_up_outputs():
    seen = []
    rec = bench.measure(bench.get_contender("flashcore:reference"), TINY, "fwd", repeat=3,
                         memory=False, check=lambda out: seen.append(out) or {"ok": True})
    assert rec["check"] == {"ok": True}
    o, lse = seen[0]
    assert o.shape == TINY.shape and lse.shape == TINY.shape[:3]


def test_a_contender_that_cannot_run_is_skipped_with_its_reason():
    rec = bench.measure(bench.JaxDpa("cudnn", "cpu"), TINY, "fwd")
    assert rec["median_s"] is None and "GPU" in rec["skipped"]


class _Failing(bench.Contender):
    name = "failing"

    def _prepare(self, config, direction, host):
        def call():
            raise RuntimeError("declined: no kernel for this shape\nsecond line")
        return bench.Prepared(call)


class _FailsLater(bench.Contender):
    name = "fails-later"

    def _prepare(self, config, direction, host):
        calls = []

        def call():
            calls.append(1)
            if len(calls) > 1:
                raise MemoryError("out of memory")
            return 0
        return bench.Prepared(call)


def test_failures_are_recorded_not_raised():
    rec = bench.measure(_Failing(), TINY, "fwd")
    assert rec["skipped"] == "RuntimeError: declined: no kernel for this shape"
    rec = bench.measure(_FailsLater(), TINY, "fwd")
    assert rec["error"] == "MemoryError: out of memory" and rec["median_s"] is None


def test_time_runs_respects_repeat_and_budget():
    prep = bench.Prepared(lambda: None)
    assert len(bench.time_runs(prep, repeat=7, warmup=0)) == 7
    slow = bench.Prepared(lambda: __import__("time").sleep(0.02))
    assert len(bench.time_runs(slow, repeat=50, warmup=0, budget_s=0.01)) == 3


def test_time_one_run_drops_the_outputs_and_waits_for_them():
    synced = []
    prep = bench.Prepared(lambda: "out", sync=synced.append)
    assert bench.time_one_run(prep) >= 0 and synced == ["out"] and prep.outputs is None


# --- contenders taking turns -------------------------------------------------------------


class _Logged(bench.Contender):
    """A contender whose every call appends its name to a shared log: ``decline`` fails the
    first (untimed) call, ``fail_after`` fails every call after that many, ``sleep`` makes
    each call take that long."""

    def __init__(self, name, log, decline=False, fail_after=None, sleep=0.0):
        self.name, self.log = name, log
        self.decline, self.fail_after, self.sleep = decline, fail_after, sleep

    def _prepare(self, config, direction, host):
        calls = []

        def call():
            calls.append(1)
            self.log.append(self.name)
            if self.decline:
                raise RuntimeError("declined: no kernel for this shape")
            if self.fail_after is not None and len(calls) > self.fail_after:
                raise MemoryError("out of memory")
            if self.sleep:
                __import__("time").sleep(self.sleep)
            return np.zeros(4)
        return bench.Prepared(call)


def test_interleaved_contenders_take_turns_each_starting_a_round_in_turn():
    log = []
    a, b = _Logged("A", log), _Logged("B", log)
    recs = bench.measure_interleaved([a, b], TINY, "fwd", repeat=4)
    # one untimed warm-up each, 4 rounds (A B, B A, A B, B A), then one memory run each
    assert log == list("AB" + "AB" "BA" "AB" "BA" + "AB")
    assert [r["contender"] for r in recs] == ["A", "B"]
    for r in recs:
        assert r["error"] is None and r["skipped"] is None
        assert len(r["times_s"]) == 4 and r["median_s"] > 0
        assert r["host_peak_method"] is not None
    log.clear()
    three = [_Logged(n, log) for n in "ABC"]
    bench.measure_interleaved(three, TINY, "fwdbwd", repeat=3, memory=False)
    assert log == list("ABC" + "ABC" "BCA" "CAB")


def test_interleaved_budget_stops_all_after_the_round_the_slowest_passes_it():
    log = []
    fast, slow = _Logged("fast", log), _Logged("slow", log, sleep=0.02)
    recs = bench.measure_interleaved([fast, slow], TINY, "fwd", repeat=50, budget_s=0.01,
                                     memory=False)
    assert [len(r["times_s"]) for r in recs] == [3, 3]  # at least 3 rounds, then stop
    recs = bench.measure_interleaved([fast, slow], TINY, "fwd", repeat=5, budget_s=100.0,
                                     memory=False)
    assert [len(r["times_s"]) for r in recs] == [5, 5]


def test_a_skipped_or_failing_contender_leaves_the_others_their_turns():
    log = []
    cs = [_Logged("declines", log, decline=True), _Logged("A", log),
          bench.JaxDpa("cudnn", "cpu"), _Logged("fails", log, fail_after=3), _Logged("B", log)]
    recs = bench.measure_interleaved(cs, TINY, "fwd", repeat=4, memory=False)
    declined, a, gpu_only, fails, b = recs
    assert declined["skipped"] == "RuntimeError: declined: no kernel for this shape"
    assert "GPU" in gpu_only["skipped"]
    assert fails["error"] == "MemoryError: out of memory" and fails["median_s"] is None
    assert fails["times_s"] == []
    for r in (a, b):
        assert r["error"] is None and len(r["times_s"]) == 4
    # the warm-ups, then rounds starting with the 1st, 2nd, 3rd of those running: A fails B,
    # fails B A, B A fails (its 4th call raises); the 4th round, of two, starts with the 2nd
    assert log == ["declines", "A", "fails", "B"] + ["A", "fails", "B", "fails", "B", "A",
                                                     "B", "A", "fails", "B", "A"]


def _fake_registry(monkeypatch, log):
    """Two logged contenders, "fake_a" and "fake_b", known to the bench by name."""
    from flashcore.bench import sweep

    fakes = {n: _Logged(n, log) for n in ("fake_a", "fake_b")}
    names = bench.contender_names() + list(fakes)
    real = bench.get_contender
    get = lambda name: fakes[name] if name in fakes else real(name)
    monkeypatch.setattr(bench, "contender_names", lambda: names)
    monkeypatch.setattr(bench, "get_contender", get)
    monkeypatch.setattr(sweep, "get_contender", get)


def test_sweep_interleaves_by_default_and_records_it(monkeypatch):
    log = []
    _fake_registry(monkeypatch, log)
    opts = bench.SweepOptions(batch=1, heads=2, seqlens=(16,), head_dims=(8,), causal=(False,),
                               directions=("fwd",), repeat=3, memory=False, ceilings=False,
                               contenders=("fake_a", "fake_b"))
    rep = bench.run_sweep(opts, progress=False)
    bench.validate_report(rep)
    assert rep["options"]["interleave"] is True
    assert log == ["fake_a", "fake_b", "fake_a", "fake_b", "fake_b", "fake_a", "fake_a",
                   "fake_b"]
    assert all(len(r["times_s"]) == 3 for r in rep["results"])


def test_bench_no_interleave_restores_back_to_back_runs(monkeypatch, tmp_path, capsys):
    from flashcore import _cli

    log = []
    _fake_registry(monkeypatch, log)
    args = ["bench", "--seqlens", "16", "--heads", "2", "--head-dims", "8", "--causal", "no",
            "--directions", "fwd", "--repeat", "3", "--contenders", "fake_a,fake_b",
            "--no-memory", "--no-ceilings", "--no-progress"]
    assert _cli.main(args + ["--json", str(tmp_path / "turns.json")]) == 0
    assert log == ["fake_a", "fake_b"] + ["fake_a", "fake_b", "fake_b", "fake_a"] * 1 + [
        "fake_a", "fake_b"]
    log.clear()
    out = tmp_path / "back_to_back.json"
    assert _cli.main(args + ["--no-interleave", "--json", str(out)]) == 0
    assert log == ["fake_a"] * 4 + ["fake_b"] * 4  # warm-up and 3 timed runs, in a row
    rep = json.loads(out.read_text())
    bench.validate_report(rep)
    assert rep["options"]["interleave"] is False
    assert [len(r["times_s"]) for r in rep["results"]] == [3, 3]
    assert "fake_a" in capsys.readouterr().out


@pytest.mark.skipif(bench.host_peak_method() == "none", reason="no way to read the RSS here")
def test_peak_extra_host_memory_sees_allocations_outside_python():
    def touch():  # 64 MiB written, then freed before the function returns
        a = np.ones(16 << 20, dtype=np.float32)
        return float(a[-1])

    extra, method = bench.peak_extra_host_bytes(touch)
    assert method in ("VmHWM", "sampler")
    assert extra >= 48 << 20
    small, _ = bench.peak_extra_host_bytes(lambda: 1)
    assert small < 16 << 20


def test_memory_guard_skips_materializing_contenders_that_would_not_fit():
    huge = bench.Config(batch=64, heads=64, seqlen=1 << 17, head_dim=64)
    why = bench.get_contender("numpy_naive").unavailable_reason(huge)
    assert why is not None and "GiB" in why
    assert bench.get_contender("numpy_naive").unavailable_reason(TINY) is None


# --- contenders --------------------------------------------------------------------------


def test_contender_names_are_unique_and_gpu_ones_exist_without_a_gpu():
    names = bench.contender_names()
    assert len(names) == len(set(names))
    for n in ("flashcore:numba_cpu", "flashcore:numba_cuda@gpu", "torch_sdpa",
              "torch_sdpa_flash@gpu", "torch_sdpa_cudnn@gpu", "torch_sdpa_efficient@gpu",
              "torch_sdpa_math@gpu", "jax_xla", "jax_cudnn@gpu", "numpy_naive",
              "torch_naive@gpu"):
        assert n in names
    with pytest.raises(ValueError, match="contender 'nope' is not one of"):
        bench.get_contender("nope")


def test_gpu_contenders_say_why_they_cannot_run_on_a_machine_without_a_gpu():
    if bench.gpu_library() is not None:
        pytest.skip("this machine has a GPU")
    for c in bench.contenders("cuda"):
        assert c.unavailable_reason() is not None, c.name


def test_default_contenders_are_usable_here_and_include_naive():
    chosen = bench.default_contenders("cpu")
    names = [c.name for c in chosen]
    assert "numpy_naive" in names
    assert any(c.kind == "flashcore" for c in chosen)
    assert all(c.unavailable_reason() is None for c in chosen)


def test_backend_reason_never_raises(monkeypatch):
    from flashcore import _dispatch

    def broken(name):
        raise AttributeError("module has no attribute 'unavailable_reason'")
    monkeypatch.setattr(_dispatch, "unavailable_reason", broken)
    assert "does not answer" in bench.backend_reason("numba_cpu")


# --- sweep, ratios, schema, tables, plots ------------------------------------------------


def _tiny_sweep(**kw):
    names = ["flashcore:reference", "numpy_naive"] + (["torch_sdpa"] if HAS_TORCH else [])
    opts = bench.SweepOptions(batch=1, heads=2, seqlens=(16, 32), head_dims=(8,),
                               causal=(False, True), repeat=3, contenders=tuple(names),
                               ceilings=False, **kw)
    return bench.run_sweep(opts, progress=False)


@pytest.fixture(scope="module")
def report():
    return _tiny_sweep()


def test_sweep_report_follows_the_schema(report):
    bench.validate_report(report)
    json.loads(json.dumps(report))  # JSON-able as is
    assert report["schema"] == "flashcore-bench/1"
    assert len(report["results"]) == 2 * 2 * 2 * len(report["contenders"])
    assert all(r["median_s"] for r in report["results"])


def test_validate_report_names_what_is_wrong(report):
    bad = json.loads(json.dumps(report))
    del bad["results"][0]["median_s"]
    with pytest.raises(ValueError, match=r"results\[0\] lacks the key 'median_s'"):
        bench.validate_report(bad)
    with pytest.raises(ValueError, match="lacks the key 'schema'"):
        bench.validate_report({})


def test_ratios_are_relative_to_the_fastest_peer(report):
    for r in report["results"]:
        same = [x for x in report["results"]
                if x["config"] == r["config"] and x["direction"] == r["direction"]]
        best = min(x["median_s"] for x in same if x["kind"] == "peer")
        assert r["ratio_to_best_peer"] == pytest.approx(r["median_s"] / best)
        if r["contender"] == r["best_peer"]:
            assert r["ratio_to_best_peer"] == 1.0


def test_tables_show_every_contender_and_direction(report):
    text = bench.format_tables(report)
    for name in ("flashcore:reference", "numpy_naive"):
        assert name in text
    assert "forward:" in text and "forward+backward:" in text and "x peer" in text
    assert "GFLOP/s" in text


def test_tables_show_skips_and_errors():
    recs = [bench.measure(bench.JaxDpa("cudnn", "cpu"), TINY, "fwd"),
            bench.measure(_FailsLater(), TINY, "fwd")]
    bench.add_ratios(recs)
    text = bench.format_tables({"results": recs, "ceilings": None})
    assert "skipped: cuDNN needs a GPU" in text and "error: MemoryError" in text


def test_ratio_tables_divide_by_each_named_contender(report):
    text = bench.format_ratios(report, ["numpy_naive", "nobody"])
    assert "/ numpy_naive" in text and "/ nobody" in text
    rows = [line for line in text.splitlines() if line.startswith("forward")]
    assert len(rows) == 8 * (len(report["contenders"]) - 1)  # all but the named one
    times = {(json.dumps(r["config"], sort_keys=True), r["direction"], r["contender"]):
             r["median_s"] for r in report["results"]}
    for r in report["results"]:
        if r["contender"] != "flashcore:reference":
            continue
        key = (json.dumps(r["config"], sort_keys=True), r["direction"])
        want = f"{r['median_s'] / times[(*key, 'numpy_naive')]:.2f}"
        label = bench.Config(**r["config"]).label()
        prefix = f"{bench.DIRECTION_LABEL[r['direction']]:<17} {label:<44} flashcore:reference "
        line = next(x for x in rows if x.startswith(prefix))
        assert line.split()[-2:] == [want, "-"]  # "-": no contender called "nobody" ran


def test_host_overhead_times_one_call_of_each_contender():
    rec = bench.measure_host_overhead(bench.get_contender("numpy_naive"), TINY, inner=20, repeat=2)
    assert rec["error"] is None and rec["skipped"] is None and rec["us_per_call"] > 0
    skipped = bench.measure_host_overhead(bench.JaxDpa("cudnn", "cpu"), TINY, inner=20, repeat=2)
    assert skipped["us_per_call"] is None and "GPU" in skipped["skipped"]
    text = bench.format_host_overhead({"host_overhead": [rec, skipped]})
    assert "numpy_naive" in text and " us" in text and "skipped: cuDNN needs a GPU" in text


def test_host_seconds_per_call_waits_for_the_last_output_after_each_block():
    synced = []
    s = bench.host_seconds_per_call(lambda: 7, sync=synced.append, inner=10, repeat=3,
                                    warmup=2)
    assert s > 0 and synced == [7, 7, 7, 7]


@pytest.mark.skipif(not HAS_MPL, reason="needs matplotlib")
def test_plots_are_written(report, tmp_path):
    rep = dict(report, ceilings={"mem_bw_GBps": 10.0, "gemm_GFLOPps": 100.0,
                                 "gemm_dtype": "float32", "how": "test"})
    paths = bench.plot(rep, tmp_path / "plots")
    names = sorted(p.rsplit("/", 1)[-1] for p in paths)
    assert names == ["roofline.png", "time_vs_seqlen_fwd.png", "time_vs_seqlen_fwdbwd.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_ceilings_are_measured_on_the_cpu():
    c = bench.measure_ceilings("cpu", quick=True)
    assert c["mem_bw_GBps"] > 0 and c["gemm_GFLOPps"] > 0 and c["gemm_dtype"] == "float32"


# --- progress ----------------------------------------------------------------------------


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_progress_redraws_on_a_terminal_and_prints_lines_otherwise():
    tty, log = _Tty(), io.StringIO()
    for stream in (tty, log):
        bar = bench.Progress(2, stream=stream)
        for label in ("one", "two"):
            bar.step(label)
            bar.advance()
        bar.close()
    assert "\r" in tty.getvalue() and "2/2" in tty.getvalue() and "done" in tty.getvalue()
    assert log.getvalue().splitlines()[0].startswith("[1/2") and "\r" not in log.getvalue()
    quiet = io.StringIO()
    bar = bench.Progress(2, stream=quiet, enabled=False)
    bar.step("x")
    assert quiet.getvalue() == ""


# --- the command -------------------------------------------------------------------------


def test_bench_command_writes_json_and_plots(tmp_path):
    out, plots = tmp_path / "bench.json", tmp_path / "plots"
    args = ["bench", "--seqlens", "16,32", "--heads", "2", "--head-dims", "8", "--causal",
            "no", "--repeat", "3", "--contenders", "flashcore:reference,numpy_naive",
            "--json", str(out), "--no-ceilings"]
    if HAS_MPL:
        args += ["--plot", str(plots)]
    p = run_cli(*args)
    assert p.returncode == 0, p.stderr
    assert "forward+backward:" in p.stdout and "numpy_naive" in p.stdout
    assert "[1/8" in p.stderr  # the progress lines (stderr is not a terminal here)
    rep = json.loads(out.read_text())
    bench.validate_report(rep)
    assert {r["contender"] for r in rep["results"]} == {"flashcore:reference", "numpy_naive"}
    assert {r["config"]["seqlen"] for r in rep["results"]} == {16, 32}
    if HAS_MPL:
        assert sorted(f.name for f in plots.iterdir()) == [
            "roofline.png", "time_vs_seqlen_fwd.png", "time_vs_seqlen_fwdbwd.png"]


def test_bench_command_prints_ratios_and_host_overhead_on_request(tmp_path):
    out = tmp_path / "bench.json"
    p = run_cli("bench", "--seqlens", "16", "--heads", "2", "--head-dims", "8", "--causal",
                "no", "--directions", "fwd", "--repeat", "3", "--no-ceilings", "--no-progress",
                "--contenders", "flashcore:reference,numpy_naive", "--ratio-to", "numpy_naive",
                "--host-overhead", "--json", str(out))
    assert p.returncode == 0, p.stderr
    assert "time / the named contender's time" in p.stdout and "/ numpy_naive" in p.stdout
    assert "host time of one forward call, B=1 H=1 N=16 D=8 float32" in p.stdout
    rep = json.loads(out.read_text())
    bench.validate_report(rep)
    assert [r["contender"] for r in rep["host_overhead"]] == ["flashcore:reference",
                                                             "numpy_naive"]


def test_side_by_side_names_the_gpu_comparison():
    opts = bench.SweepOptions(**bench.SIDE_BY_SIDE)
    assert opts.device == "cuda" and opts.contenders[0] == "flashcore:numba_cuda@gpu"
    assert set(bench.SIDE_BY_SIDE_PEERS) <= set(opts.contenders)
    assert all(n in bench.contender_names() for n in opts.contenders)


def test_bench_list_names_every_contender():
    p = run_cli("bench", "--list")
    assert p.returncode == 0
    for name in bench.contender_names():
        assert name in p.stdout


@pytest.mark.parametrize("args, needle", [
    (["--seqlens", "128,x"], "argument --seqlens: expected a positive integer, got 'x'"),
    (["--seqlens", "0"], "argument --seqlens: expected a positive integer, got '0'"),
    (["--head-dims", "512"], "argument --head-dims: head dim must be between 1 and 256"),
    (["--dtypes", "float32,int8"], "argument --dtypes: 'int8' not among"),
    (["--contenders", "numpy_naive,cuda_magic"], "argument --contenders: 'cuda_magic' not among"),
    (["--causal", "maybe"], "argument --causal: invalid choice: 'maybe'"),
    (["--budget", "-1"], "argument --budget: expected a positive number, got '-1'"),
], ids=["seqlens", "seqlens-zero", "head-dim", "dtype", "contender", "causal", "budget"])
def test_bench_bad_options_get_clear_messages(args, needle, capsys):
    # in process, as tests/test_cli.py checks the other commands' options (a subprocess per
    # case cost ~3 s of imports each; the tests above run the command as a subprocess)
    from flashcore import _cli

    with pytest.raises(SystemExit) as e:
        _cli.main(["bench", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert needle in err, err


def test_runner_modules_import_no_framework():
    code = ("import sys, flashcore, flashcore.bench, flashcore._cli, flashcore.__main__; "
            "import flashcore.bench.plots, flashcore.bench.sweep; "
            "print(sorted(m for m in ('torch', 'jax', 'cupy', 'matplotlib') if m in sys.modules))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_asv_suite_loads_this_trees_bench_package_by_path():
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, 'asv_bench'); from benchmarks import common; "
            "r = common.runner; print(r.__name__, r.__file__); "
            "print(r.get_contender('numpy_naive').name, "
            "sys.modules['flashcore_bench_runner.naive'].__file__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stderr
    name, path, contender, naive = p.stdout.split()
    assert name == "flashcore_bench_runner" and contender == "numpy_naive"
    assert path == str(root / "flashcore" / "bench" / "__init__.py")
    assert naive == str(root / "flashcore" / "bench" / "naive.py")



def test_machine_block_records_the_instruction_set():
    from flashcore.bench.machine import ISA_FLAGS, cpu_flags, machine_info

    info = machine_info()
    assert info["cpu_flags"] == cpu_flags()
    assert set(info["cpu_flags"]) <= set(ISA_FLAGS)
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return
    if " avx2" in text:
        assert "avx2" in info["cpu_flags"]


def test_machine_block_records_the_numba_cpu_target(monkeypatch):
    """The machine block says what the CPU kernels were compiled for (a run under
    NUMBA_CPU_NAME without NUMBA_CPU_FEATURES takes 128-bit vectors: its numbers are not
    the host's), and the report prints it."""
    pytest.importorskip("numba")
    from flashcore.backends.numba_cpu import simd

    from flashcore.bench.machine import machine_info
    from flashcore.bench.report import format_tables

    t = machine_info()["numba_cpu_target"]
    assert t["vector_bits"] == simd.VECTOR_BITS in (128, 256, 512)
    from numba.core import config

    monkeypatch.setattr(config, "CPU_NAME", "haswell")
    monkeypatch.setattr(config, "CPU_FEATURES", None)
    assert simd.host_vector_bits() == 128
    text = format_tables({"results": [], "machine": {"cpu_flags": ["avx2"], "cpu": "x",
                                     "numba_cpu_target": {"cpu_name": "haswell",
                                                          "cpu_features": None,
                                                          "vector_bits": 128}}})
    assert "numba_cpu: 128-bit vectors, compiled for haswell" in text
