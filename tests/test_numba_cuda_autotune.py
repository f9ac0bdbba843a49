"""The tensor-core autotuner's cache and how tilings.choose_tc reads it (no GPU needed;
the tuner's timing runs on the device: the tune stage of tools/gpu_session.sh)."""
from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed")


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    from flashcore.backends.numba_cuda import autotune, tilings

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    tilings.forget_tuned()
    yield autotune, tilings
    tilings.forget_tuned()


def _write(autotune, entries):
    path = autotune.cache_path()
    path.write_text(json.dumps({autotune.cache_key(*k): {"tiles": v} for k, v in entries}))
    return path


def test_cache_path_follows_environment(tuner, tmp_path):
    autotune, tt = tuner
    assert autotune.cache_path() == tmp_path / "tc_tiles.json"
    assert tt.load_cache() == {}  # no file yet


def test_choose_prefers_the_tuned_tiling(tuner):
    autotune, tt = tuner
    gpu, cc = "NVIDIA Fake GPU", (9, 0)
    _write(autotune, [((gpu, cc, "dkdv", 64, False, "bfloat16"), [8, 32]),
                      ((gpu, cc, "forward", 64, True, "bfloat16"), [4, 32, 2]),
                      ((gpu, cc, "dq", 128, True, "bfloat16"), [3, 17])])  # invalid: ignored
    got = tt.choose_tc("dkdv", 64, "bfloat16", False, cc, gpu=gpu, simulator=False)
    assert got == tt.TCTiles(8, 32)
    assert tt.choose_tc("forward", 64, "bfloat16", True, cc, gpu=gpu, simulator=False) \
        == tt.TCTiles(4, 32, 2)
    # another GPU, causality or dtype: the built-in table
    assert tt.choose_tc("dkdv", 64, "bfloat16", False, cc, gpu="other", simulator=False) \
        == tt.DKDV[64, False]
    assert tt.choose_tc("dkdv", 64, "bfloat16", True, cc, gpu=gpu, simulator=False) \
        == tt.DKDV[64, True]
    assert tt.choose_tc("dq", 128, "bfloat16", True, cc, gpu=gpu, simulator=False) \
        == tt.DQ[128, True]
    assert tt.choose_tc("forward", 96, "bfloat16", False, simulator=False) == tt.FORWARD[96, False]


def test_unreadable_cache_is_ignored(tuner):
    autotune, tt = tuner
    tt.cache_path().write_text("{not json")
    assert tt.load_cache() == {}
    assert tt.choose_tc("dq", 64, "bfloat16", False, (9, 0), gpu="g",
                        simulator=False) == tt.DQ[64, False]


def test_candidates_are_valid_and_fit(tuner):
    autotune, tt = tuner
    for kernel, cands in autotune.CANDIDATES.items():
        assert tt.TABLES[kernel][64, False] in cands, kernel  # the defaults are among them
        for d in tt.HEAD_DIMS:
            assert any(tt.fits(kernel, t, d, (8, 0)) for t in cands)


@pytest.mark.parametrize("argv, needle", [
    (["--kernels", "forward,bogus"], "'bogus'"),
    (["--head-dims", "64,80"], "80"),
])
def test_cli_rejects_bad_arguments(tuner, argv, needle, capsys):
    autotune, _ = tuner
    with pytest.raises(SystemExit) as e:
        autotune.main(argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


@pytest.mark.parametrize("kernel", ["forward", "dkdv", "dq"])
def test_candidate_launch_arguments(tuner, kernel, monkeypatch):
    """time_candidate launches through launch.launch_forward/dkdv/dq: the grid and the
    packed arguments are those of the kernel's signature for a (B, H, N, D) bhnd case (no
    GPU: numba.cuda's allocation and events are replaced by fakes)."""
    import contextlib
    import types

    from flashcore.backends.numba_cuda import driver, launch
    from numba import cuda

    autotune, tt = tuner
    B, H, N, D = 2, 3, 100, 64
    bufs = []

    def to_device(a):
        bufs.append(a)
        return types.SimpleNamespace(__cuda_array_interface__={"data": (1000 * len(bufs),
                                                                          False)})

    calls = []
    monkeypatch.setattr(cuda, "gpus", {0: contextlib.nullcontext()}, raising=False)
    monkeypatch.setattr(cuda, "to_device", to_device)
    monkeypatch.setattr(cuda, "synchronize", lambda: None)
    monkeypatch.setattr(cuda, "event", lambda timing: types.SimpleNamespace(
        record=lambda: None, synchronize=lambda: None))
    monkeypatch.setattr(cuda, "event_elapsed_time", lambda a, b: 1.0)
    monkeypatch.setattr(driver, "synchronize", lambda stream, device=0: None)
    monkeypatch.setattr(autotune, "_kernel", lambda *a: (
        lambda grid, stream, args: calls.append((grid, stream, args)), 32))
    assert autotune.time_candidate(kernel, tt.TCTiles(2, 32), D, True, "bfloat16", 0, B, H, N,
                                   reps=2) == 1.0
    grid, stream, args = calls[0]
    assert all(c == calls[0] for c in calls) and len(calls) == 5 and stream == 0
    # (the forward's grid has a z axis: the splits of split-KV, 1 here; the dK/dV one's: the
    # blocks per key tile, tilings.dkdv_passes, 1 but for the wgmma kernel at D=256)
    assert grid == ((N + 31) // 32, B * H) + ((1,) if kernel in ("forward", "dkdv") else ())
    q, k, v, do, o, dq, dk, dv, lse, delta = (1000 * (i + 1) for i in range(10))
    st = (N * D * H, N * D, D, 1)
    lst = (N * H, N, 1)
    scale = D ** -0.5
    # (no ALiBi: a float32 buffer no kernel reads, zero strides; no mod_args: that buffer
    # for each of the 4 pointers, extents 0; no tile classes: that buffer, strides 0)
    no_slopes = (delta, 0, 0, delta, delta, delta, delta) + (0,) * 16 + (delta, 0, 0, 0)
    # (a dense call: the packed-rows arguments are a buffer no kernel reads, page size 1,
    # no sequences)
    packed = lambda x: (x, x, x, x, 0, 1, 0, 0, 0, 0, 0, 0)  # noqa: E731
    expected = {
        "forward": (q, k, v, o, lse, N, N, H, 1, 0, *st, *st, *st, *st, scale, *no_slopes,
                    *packed(lse)),
        "dkdv": (q, k, v, do, lse, delta, dk, dv, N, N, H, H, 1, 0, *st, *st, *st, *st, *st,
                 *st, *lst, scale, *no_slopes, *packed(delta)),
        "dq": (q, k, v, do, lse, delta, dq, N, N, H, 1, 0, *st, *st, *st, *st, *st, *lst,
               scale, *no_slopes, *packed(delta)),
    }[kernel]
    assert args == expected
    assert len(args) == len(launch.signature(f"attn_{'backward_' if kernel != 'forward' else ''}"
                                             f"{kernel}", "bfloat16"))


def test_tables_fall_back_where_shared_memory_is_smaller(tuner):
    """The built-in tables are the H200's choices; on a GPU with less shared memory the
    largest candidate that fits is taken, and none at all leaves the case to SIMT."""
    autotune, tt = tuner
    for cc in [(8, 0), (8, 6), (9, 0)]:
        for kernel, table in tt.TABLES.items():
            for (d, causal), t in table.items():
                got = tt.choose_tc(kernel, d, "bfloat16", causal, cc, simulator=False)
                if tt.fits(kernel, t, d, cc):
                    assert got == t
                elif got is not None:
                    assert tt.fits(kernel, got, d, cc) and got in autotune.CANDIDATES[kernel]
    choose = lambda *a: tt.choose_tc(*a, simulator=False)  # noqa: E731
    assert choose("forward", 256, "bfloat16", False, (9, 0)) == tt.FORWARD[256, False]
    assert choose("forward", 256, "bfloat16", False, (8, 0)) == tt.TCTiles(4, 32)
    assert choose("dkdv", 256, "bfloat16", True, (8, 0)) == tt.TCTiles(4, 32, 1, 2)
    assert choose("dkdv", 256, "bfloat16", True, (8, 6)) is None
