"""The tensor-core autotuner's cache and how tile_product_tc.choose reads it (no GPU needed;
the tuner's timing runs on the device, tools/gpu_final.sh)."""
from __future__ import annotations

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed")


@pytest.fixture
def tuner(tmp_path, monkeypatch):
    from flashcore.backends.numba_cuda import autotune, tile_product_tc

    monkeypatch.setenv("FLASHCORE_CACHE_DIR", str(tmp_path))
    tile_product_tc.forget_tuned()
    yield autotune, tile_product_tc
    tile_product_tc.forget_tuned()


def _write(autotune, entries):
    path = autotune.cache_path()
    path.write_text(json.dumps({autotune.cache_key(*k): {"tiles": v} for k, v in entries}))
    return path


def test_cache_path_follows_environment(tuner, tmp_path):
    autotune, _ = tuner
    assert autotune.cache_path() == tmp_path / "tc_tiles.json"
    assert autotune.load_cache() == {}  # no file yet


def test_choose_prefers_the_tuned_tiling(tuner):
    autotune, tt = tuner
    gpu, cc = "NVIDIA Fake GPU", (9, 0)
    _write(autotune, [((gpu, cc, "dkdv", 64, False, "bfloat16"), [8, 32]),
                      ((gpu, cc, "forward", 64, True, "bfloat16"), [4, 32, 2]),
                      ((gpu, cc, "dq", 128, True, "bfloat16"), [3, 17])])  # invalid: ignored
    got = tt.choose("dkdv", 64, False, "bfloat16", gpu, cc, simulator=False)
    assert got == tt.TCTiles(8, 32)
    assert tt.choose("forward", 64, True, "bfloat16", gpu, cc, simulator=False) \
        == tt.TCTiles(4, 32, 2)
    # another GPU, causality or dtype: the built-in table
    assert tt.choose("dkdv", 64, False, "bfloat16", "other", cc, simulator=False) \
        == tt.DKDV[64, False]
    assert tt.choose("dkdv", 64, True, "bfloat16", gpu, cc, simulator=False) \
        == tt.DKDV[64, True]
    assert tt.choose("dq", 128, True, "bfloat16", gpu, cc, simulator=False) \
        == tt.DQ[128, True]
    assert tt.choose("forward", 96, simulator=False) == tt.FORWARD[96, False]


def test_unreadable_cache_is_ignored(tuner):
    autotune, tt = tuner
    autotune.cache_path().write_text("{not json")
    assert autotune.load_cache() == {}
    assert tt.choose("dq", 64, False, "bfloat16", "g", (9, 0), simulator=False) == tt.DQ[64, False]


def test_candidates_are_valid_and_fit(tuner):
    autotune, tt = tuner
    for kernel, cands in autotune.CANDIDATES.items():
        assert tt.TABLES[kernel][64, False] in cands, kernel  # the defaults are among them
        for d in tt.HEAD_DIMS:
            assert any(autotune._fits(kernel, t, d, (8, 0)) for t in cands)


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
