"""The bench's masked cases (flashcore.bench.masks, ``--masks``): parsing, labels and JSON, the
visible-fraction FLOP model, skips, every peer given the same scores as flashcore's
reference, and one small masked sweep on numba_cpu. Tiny sizes; the user functions are the
module-level ones of flashcore.bench.masks, so each compiles once per process."""
from __future__ import annotations

import json

import numpy as np
import pytest

from flashcore import _cli, bench
from flashcore.bench import masks

HAS_TORCH = bench.has_module("torch")
MASKS = ("window:16", "docs:4", "softcap:2", "softcap-py:2", "alibi", "relpos")


# --- parsing, the CLI option, labels and JSON ---------------------------------------------


@pytest.mark.parametrize("text, kind, value, canonical", [
    ("none", "none", None, "none"), ("window:512", "window", 512, "window:512"),
    ("docs:8", "docs", 8, "docs:8"), ("softcap:30.0", "softcap", 30.0, "softcap:30"),
    ("softcap-py:2.5", "softcap-py", 2.5, "softcap-py:2.5"), (" alibi ", "alibi", None, "alibi"),
    ("relpos", "relpos", None, "relpos"),
])
def test_masks_parse_to_a_canonical_text(text, kind, value, canonical):
    m = bench.parse_mask(text)
    assert (m.kind, m.value, m.text) == (kind, value, canonical)


@pytest.mark.parametrize("text, needle", [
    ("windows:4", "is not one of"), ("window", "needs a number"), ("window:", "needs a number"),
    ("window:1.5", "not an integer"), ("docs:0", "must be positive"),
    ("softcap:nan", "must be positive"), ("alibi:3", "takes no number"),
])
def test_bad_masks_are_named(text, needle):
    with pytest.raises(ValueError, match=needle):
        bench.parse_mask(text)
    with pytest.raises(ValueError, match=needle):
        bench.Config(mask=text)


def test_the_cli_option_parses_dedups_and_defaults_to_non_causal_with_masks():
    p = _cli._bench_parser()
    args = p.parse_args(["--masks", "none,window:512,docs:8,softcap:30.0,softcap:30,alibi"])
    assert args.masks == ("none", "window:512", "docs:8", "softcap:30", "alibi")
    assert p.parse_args([]).masks == ("none",)
    with pytest.raises(SystemExit):
        p.parse_args(["--masks", "window:x"])


def test_bench_command_rejects_a_bad_mask_with_a_clear_message(capsys):
    with pytest.raises(SystemExit):
        _cli.main(["bench", "--masks", "none,windw:4"])
    assert "'windw' is not one of" in capsys.readouterr().err


def test_window_is_w_keys_per_query():
    assert bench.parse_mask("window:512").window() == (256, 255)
    assert bench.parse_mask("window:5").window() == (2, 2)
    assert bench.parse_mask("docs:8").window() is None


def test_labels_and_json_change_only_when_a_mask_is_asked():
    plain, masked = bench.Config(1, 4, 64, 8), bench.Config(1, 4, 64, 8, mask="window:16")
    assert plain.label() == "B=1 H=4 N=64 D=8 float32 non-causal"
    assert masked.label() == "B=1 H=4 N=64 D=8 float32 non-causal window:16"
    assert "mask" not in plain.as_dict() and masked.as_dict()["mask"] == "window:16"
    assert bench.Config(**masked.as_dict()) == masked
    assert "block_mask" in masks.label("docs:8")
    opts = bench.SweepOptions(seqlens=(64,), causal=(False,), masks=("none", "docs:4"))
    assert [c.mask for c in opts.configs()] == ["none", "docs:4"] and opts.masked
    assert not bench.SweepOptions().masked


# --- the FLOP model ----------------------------------------------------------------------


def _brute_fraction(config):
    vis = masks.dense_visible(config)
    if vis is None:
        return None
    return vis.sum() / (vis.shape[0] * config.seqlen ** 2)


@pytest.mark.parametrize("mask", ["window:16", "window:7", "docs:4", "docs:5"])
@pytest.mark.parametrize("causal", [False, True])
def test_sparse_masks_count_the_visible_pairs_exactly(mask, causal):
    c = bench.Config(2, 2, 64, 8, causal=causal, mask=mask)
    assert c.visible_fraction() == pytest.approx(_brute_fraction(c), rel=1e-12)
    full = 4.0 * 2 * 2 * 64 * 64 * 8
    assert c.flops("fwd") == pytest.approx(full * c.visible_fraction())
    assert c.flops("fwdbwd") == pytest.approx(3.5 * c.flops("fwd"))


def test_flop_model_is_about_w_over_n_and_one_over_k_and_unchanged_otherwise():
    n = 8192
    assert bench.Config(seqlen=n, mask="window:512").visible_fraction() == pytest.approx(
        512 / n, rel=0.02)
    assert bench.Config(seqlen=n, mask="docs:8").visible_fraction() == 1 / 8
    for m in ("none", "softcap:30", "alibi", "relpos"):
        assert bench.Config(seqlen=n, mask=m).flops("fwd") == bench.Config(seqlen=n).flops("fwd")
        assert bench.Config(seqlen=n, causal=True, mask=m).visible_fraction() == 0.5
    c = bench.Config(seqlen=n, mask="docs:8")
    assert c.io_bytes("fwd", True) < bench.Config(seqlen=n).io_bytes("fwd", True)


# --- skips -------------------------------------------------------------------------------


def test_peers_that_cannot_express_a_mask_say_why():
    soft = bench.Config(1, 2, 32, 8, mask="softcap:30")
    assert "no softcap" in bench.TorchSdpa().mask_reason(soft)
    assert bench.TorchSdpa().mask_reason(bench.Config(mask="docs:8")) is None
    assert "no masks" in bench.JaxDpa().mask_reason(soft)
    assert bench.JaxDpa().mask_reason(bench.Config()) is None
    assert "CUDA only" in bench.TorchFlex("cpu").unavailable_reason(soft)
    assert "torch_flex@gpu" in bench.NOT_BY_DEFAULT and "torch_flex@gpu" in bench.WITH_MASKS
    rec = bench.measure(bench.Naive("numpy"), soft, "fwdbwd", repeat=1, memory=False)
    assert "softcap" in rec["skipped"] and rec["mask_how"]
    if HAS_TORCH:
        rec = bench.measure(bench.TorchSdpa(), soft, "fwd", repeat=1, memory=False)
        assert "no softcap" in rec["skipped"]


def test_flashcore_backends_that_decline_masks_are_skipped_with_their_reason():
    cfg = bench.Config(1, 2, 32, 8, mask="window:8")
    c = bench.FlashcoreContender("torch", "torch") if HAS_TORCH else None
    if c is None or c.unavailable_reason(cfg) is not None:
        pytest.skip("flashcore's torch backend is not usable here")
    rec = bench.measure(c, cfg, "fwd", repeat=1, memory=False)
    assert rec["skipped"] and "window" in rec["skipped"] and rec["error"] is None


# --- every contender computes the same scores --------------------------------------------


def _peers():
    out = [bench.Naive("numpy")]
    if HAS_TORCH:
        out += [bench.TorchSdpa(), bench.TorchFlex("cpu", compiled=False)]
    return out


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_peers_get_the_same_masked_scores_as_flashcore(mask, causal):
    config = bench.Config(2, 2, 64, 8, "float64", causal, mask)
    host = bench.host_inputs(config, seed=1)
    ref = bench.FlashcoreContender("reference", "numpy").prepare(config, "fwd", host=host).run()
    for peer in _peers():
        if peer.unavailable_reason(config) is not None:
            continue
        with np.errstate(all="ignore"):
            out = peer.prepare(config, "fwd", host=host).run()
        o = out[0] if isinstance(out, tuple) else out
        o = o.detach().numpy() if hasattr(o, "detach") else np.asarray(o)
        np.testing.assert_allclose(o, ref[0], rtol=1e-9, atol=1e-10, err_msg=peer.name)


@pytest.mark.skipif(not HAS_TORCH, reason="needs PyTorch")
@pytest.mark.parametrize("mask", ["docs:4", "alibi"])
def test_peer_gradients_match_flashcore_under_a_mask(mask):
    config = bench.Config(1, 2, 64, 8, "float64", True, mask)
    host = bench.host_inputs(config, seed=2)
    ref = bench.FlashcoreContender("reference", "numpy").prepare(config, "fwdbwd",
                                                                 host=host).run()
    for peer in (bench.Naive("numpy"), bench.TorchSdpa()):
        grads = peer.prepare(config, "fwdbwd", host=host).run()
        for g, r in zip(grads, ref):
            g = g.detach().numpy() if hasattr(g, "detach") else g
            np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6, err_msg=peer.name)


# --- one masked sweep on numba_cpu -------------------------------------------------------


@pytest.fixture(scope="module")
def masked_report():
    names = ["flashcore:numba_cpu", "numpy_naive"] + (["torch_sdpa"] if HAS_TORCH else [])
    opts = bench.SweepOptions(batch=1, heads=2, seqlens=(256,), head_dims=(16,),
                              causal=(False,), masks=("none", "window:64", "docs:4"),
                              directions=("fwd",), repeat=2, contenders=tuple(names),
                              ceilings=False, memory=False)
    return bench.run_sweep(opts, progress=False)


def test_a_masked_sweep_runs_on_numba_cpu(masked_report):
    bench.validate_report(masked_report)
    json.dumps(masked_report)
    rs = masked_report["results"]
    assert {r["config"].get("mask", "none") for r in rs} == {"none", "window:64", "docs:4"}
    assert list(masked_report["options"]["masks"]) == ["none", "window:64", "docs:4"]
    own = [r for r in rs if r["contender"] == "flashcore:numba_cpu"]
    assert all(r["median_s"] and r["error"] is None and r["skipped"] is None for r in own)
    docs = next(r for r in own if r["config"].get("mask") == "docs:4")
    assert "block_mask" in docs["mask_how"]
    assert docs["flops"] == pytest.approx(4 * 2 * 256 * 256 * 16 / 4)
    text = bench.format_tables(masked_report)
    assert "mask docs:4 (flashcore: mask_mod same_doc + block_mask made untimed)" in text
    assert "flashcore:numba_cpu: window=(32, 31)" in text
    ratios = bench.format_mask_ratios(masked_report)
    assert ratios.count("flashcore:numba_cpu") == 2 and "/ none" in ratios


def test_a_sweep_without_masks_writes_the_json_it_always_wrote():
    opts = bench.SweepOptions(seqlens=(16,), head_dims=(8,), causal=(False,),
                              directions=("fwd",), repeat=1, contenders=("numpy_naive",),
                              ceilings=False, memory=False)
    report = bench.run_sweep(opts, progress=False)
    assert "masks" not in report["options"]
    assert all("mask" not in r["config"] and "mask_how" not in r for r in report["results"])
    assert bench.format_mask_ratios(report) == ""
    assert "mask" not in bench.format_tables(report).split("time: median")[0]


def test_asv_suite_has_the_masked_cpu_cases():
    import pathlib
    import subprocess
    import sys

    root = pathlib.Path(__file__).resolve().parents[1]
    code = ("import sys; sys.path.insert(0, 'asv_bench'); from benchmarks import bench_attention "
            "as b; c = b.MaskedForwardCPU; print(c.param_names, c.params, c.seqlen, "
            "b.MaskedForwardBackwardCPU.direction); "
            "cfg = b.runner.Config(1, 4, 2048, 64, 'float32', False, 'docs:8'); "
            "print(cfg.label(), cfg.flops('fwd'))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root)
    assert p.returncode == 0, p.stderr
    assert "['contender', 'mask']" in p.stdout and "'window:512', 'docs:8'" in p.stdout
    assert "fwdbwd" in p.stdout and "docs:8" in p.stdout
