"""The sm_90a backward with wgmma (backends/numba_cuda/hopper/backward.py).

- Host side (any machine with numba-cuda): the kernels' elementwise step, run per thread of
  a warpgroup on score tiles laid out as wgmma's accumulators (``wgmma.acc_coords``), gives
  Pᵀ and dSᵀ (dK/dV kernel: lse and delta per query column, the causal mask on diagonal
  steps, queries past Nq and rows that see no key at P = 0) and P and dS (dQ kernel: keys
  past Nk masked) as NumPy does; tilings, variants and the launch's choice. Their operand
  layouts are the forward's (test_numba_cuda_hopper.py reads them back through the
  descriptors), and the register tiles are the A fragments as P is there.
- Without a GPU: every variant compiles for sm_90a with the expected wgmma counts, no local
  memory, the launch's parameter list; where ptxas is installed it assembles them with no
  spills and no injected warpgroup.arrive (C7519).
- On an H100/H200 (marked ``gpu``, cc 9.0 only): the wgmma backward in the table's tilings
  on every case, and in each other candidate pair on a few (that its two kernels ran is
  checked), against the float64 oracle, outputs poisoned first (conftest); then the
  mma.sync backward with FLASHCORE_HOPPER_BWD=0 on the same inputs.
"""
from __future__ import annotations

import importlib.util
import math
import os
import re
import types as pytypes
from dataclasses import replace

import numpy as np
import pytest
from hopper_helpers import (
    SHAPES,
    compile_once,
    compile_sm90a,
    gpu_inputs,
    hopper_gpu_or_skip,
    rel_bias,
    same_doc,
    spy_launches,
)

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")
HAVE = not SIM and importlib.util.find_spec("numba_cuda") is not None
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                       reason="numba-cuda is not installed"),
    pytest.mark.skipif(SIM, reason="wgmma has no CUDA-simulator form"),
]

if HAVE:
    from flashcore.backends.numba_cuda import launch, tilings
    from flashcore.backends.numba_cuda.device import prologue, seams
    from flashcore.backends.numba_cuda.device import wgmma as w
    from flashcore.backends.numba_cuda.hopper import backward_scores as hb
    from flashcore.backends.numba_cuda.variant import Variant

KERNELS = ("dkdv", "dq")
#: Every (kernel, head dim, dtype, causal) of the table; CI compiles one per kernel, head
#: dim and causal mode (both dtypes among them), the others are marked slow.
ALL = [(n, d, t, c) for n in KERNELS for d in (64, 128, 256) for t in ("bfloat16", "float16")
       for c in (False, True)] if HAVE else []
CI = {("dkdv", 64, "bfloat16", True), ("dkdv", 128, "float16", False),
      ("dq", 64, "float16", False), ("dq", 128, "bfloat16", True),
      ("dkdv", 256, "float16", True)}


def _variant(kernel, d, dtype, causal, t=None):
    return Variant(kernel, "hopper", d, dtype, causal,
                   t or tilings.choose_hopper(d, causal, kernel))


def _candidates():
    """``(kernel, tiles, head dim, causal)`` of every candidate tiling not in the table."""
    out = set()
    for (d, c), pairs in tilings.HOPPER_BWD_CANDIDATES.items():
        for pair in pairs:
            for n, t in zip(KERNELS, pair):
                if t != tilings.choose_hopper(d, c, n):
                    out.add((n, t, d, c))
    return sorted(out, key=lambda x: (x[0], x[2], x[3], x[1].tag))


# --- host side ----------------------------------------------------------------------------

def _host_st_f32(smem, i, value):
    smem[int(i):int(i) + 2] = np.array([value], np.float32).view(np.uint16)


def _host_cp_async4(smem, i, src, j, nbytes):
    assert nbytes == 4
    _host_st_f32(smem, i, src[int(j)])


@pytest.fixture
def on_host(monkeypatch):
    """The helpers the elementwise step calls, as plain Python."""
    monkeypatch.setattr(hb, "lse_log2", prologue.lse_log2.py_func)
    monkeypatch.setattr(prologue, "lse_log2", prologue.lse_log2.py_func)
    monkeypatch.setattr(hb, "hides", seams.hides.py_func)
    monkeypatch.setattr(seams, "hides", seams.hides.py_func)
    monkeypatch.setattr(hb, "visible", seams.visible.py_func)
    monkeypatch.setattr(hb, "user_hides", hb.user_hides.py_func)
    monkeypatch.setattr(hb, "user_keeps", seams.user_keeps.py_func)
    monkeypatch.setattr(hb, "user_score_slope", seams.user_score_slope.py_func)
    monkeypatch.setattr(hb, "prob", hb.prob.py_func)
    monkeypatch.setattr(hb, "grad", hb.grad.py_func)
    monkeypatch.setattr(hb, "distance", seams.distance.py_func)
    monkeypatch.setattr(hb, "alibi", seams.alibi.py_func)
    # the one-pass form packs P and dS to 16 bits as it goes (not what these tests check)
    monkeypatch.setattr(hb, "pack", lambda bf16, a, b: np.uint32(0))
    # the step's lse and delta through shared memory (a uint16 array, fp32 in pairs)
    monkeypatch.setattr(hb, "cp_async4", _host_cp_async4)
    monkeypatch.setattr(hb, "st_shared_f32", _host_st_f32)
    monkeypatch.setattr(hb, "ld_shared_f32",
                        lambda smem, i: smem[int(i):int(i) + 2].view(np.float32)[0])
    # the softcap's tanh.approx.f32 has no host form: math.tanh in its place
    monkeypatch.setattr(hb, "softcap", lambda x, cap, inv, approx: (
        np.float32(cap * math.tanh(x * inv)), np.float32(1.0 - math.tanh(x * inv) ** 2)))


#: (softcap c, ALiBi slope, the user's mods) of the host step tests, in natural units:
#: none, the softcap and ALiBi, and both with a score_mod and a mask_mod after them
HOST_MODS = {"plain": (0.0, 0.0, False), "cap+alibi": (3.0, 0.05, False),
             "cap+alibi+user": (3.0, 0.05, True)}
#: The user's mods of the host tests (natural units): a score_mod reading an array by key
#: (with its derivative, as device/user_mods' value_slope gives it) and a mask_mod
HOST_BIAS = np.array([0.5, -1.0, 0.25, 2.0, -0.75], np.float32)


def _host_value_slope(s, b, h, i, j, a):
    return (np.float32(s + 0.3 * math.sin(s) + a[0][j % 5] * (h + 1)),
            np.float32(1.0 + 0.3 * math.cos(s)))


def _host_keeps(b, h, i, j, a):
    return (i + 2 * j + h) % 7 != 0


def _user_seen(qi, kj, h):
    """Where the host tests' mask_mod keeps (queries x keys)."""
    return (qi[:, None] + 2 * kj[None, :] + h) % 7 != 0


def _modded_reference(s, scale, cap, slope, user, dist, qi, kj, h):
    """The scores (raw units) through the softcap, ALiBi and the host tests' score_mod, and
    their derivative ``d score / d raw``, in float64 (``dist``: query position minus key
    position; ``qi``, ``kj``: the tile's queries and keys, ``h`` the query head)."""
    if cap:
        t = np.tanh(s * scale / cap)
        s, g = t * cap / scale, 1.0 - t * t
    else:
        g = np.ones_like(s)
    s = s - slope / scale * np.abs(dist)
    if user:
        x = s * scale
        bias = HOST_BIAS.astype(np.float64)[kj % 5][None, :] * (h + 1)
        s = (x + 0.3 * np.sin(x) + bias) / scale
        g = g * (1.0 + 0.3 * np.cos(x))
    return s, g


def _host_mods(mods, scale, b, h, Nq, Nk):
    """The step functions' mods arguments for ``HOST_MODS[mods]``: ``(mods array, CAP,
    ALIBI, SMOD, MMOD, value_slope, keeps, user)``, in raw units."""
    cap, slope, user = HOST_MODS[mods]
    arr = np.array([cap / scale if cap else 1.0, scale / cap if cap else 1.0, slope / scale,
                    1.0 / scale, scale], np.float32)
    return (arr, bool(cap), bool(slope), user, user, _host_value_slope, _host_keeps,
            (b, h, Nq, Nk, (HOST_BIAS,)))


def _reference(s, lse, dp, delta, scale, seen):
    """P and dS of a score tile ``s`` (queries x keys) by the rule: P = exp(s scale - lse)
    where ``seen``, else 0 (lse -inf: 0)."""
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.where(seen & np.isfinite(lse)[:, None],
                     np.exp(s * scale - np.where(np.isfinite(lse), lse, 0)[:, None]), 0.0)
    return p, p * (dp - delta[:, None])


@pytest.mark.parametrize("mods", list(HOST_MODS))
@pytest.mark.parametrize("BN", [32, 64])
@pytest.mark.parametrize("step", ["inner", "diagonal", "tail"])
def test_dkdv_step_on_the_host(on_host, BN, step, mods):
    """Sᵀ and dPᵀ in wgmma's accumulator layout (one warpgroup's 64 keys x ``BN`` queries)
    become Pᵀ and dSᵀ as the rule says: per query column its lse and delta (strided lse, a
    row that sees no key has lse -inf; staged in shared memory by the block's threads and
    read back per column), the causal mask on a diagonal step, P = 0 past Nq; the softcap
    and ALiBi (with the derivative in dS), both in the overlapped form (``probs_t`` then
    ``grads_t``) and in the one-pass form (``probs_grads_t``)."""
    rng = np.random.default_rng(BN)
    scale = 0.125
    k0 = 64  # the warpgroup's keys k0 .. k0 + 63
    m = {"inner": 192, "diagonal": 64, "tail": 224}[step]  # the step's first query
    Nq = 256 if step != "tail" else 224 + BN // 2
    causal_offset = 0
    s = rng.standard_normal((64, BN)).astype(np.float32) * 4  # keys x queries
    dp = rng.standard_normal((64, BN)).astype(np.float32)
    lse = (rng.standard_normal(Nq + BN) * 2 + 3).astype(np.float32)
    lse[m + 5] = -np.inf  # a row that sees no key
    delta = rng.standard_normal(Nq + BN).astype(np.float32)
    lsn, lbase, dbase = 3, 7, 11  # lse strided, both offset
    lse_buf = np.full(lbase + lsn * (Nq + BN), np.nan, np.float32)
    lse_buf[lbase::lsn][:Nq + BN] = lse
    delta_buf = np.full(dbase + Nq + BN, np.nan, np.float32)
    delta_buf[dbase:] = delta
    sl2 = np.float32(scale * math.log2(math.e))
    mask = step == "diagonal"
    out_p = np.full((64, BN), np.nan)
    out_ds = np.full((64, BN), np.nan)
    one_p, one_ds = np.full((64, BN), np.nan), np.full((64, BN), np.nan)
    NT = BN // 8
    h = 1
    um = _host_mods(mods, scale, 0, h, Nq, 10 ** 6)
    SMOD = um[3]
    e0 = 6  # (the stats' first element in the shared array)
    smem = np.full(e0 + 4 * BN, 0x7FC0, np.uint16)  # (NaN until written)
    for t in range(128):
        hb.stage_stats.py_func(smem, e0, lse_buf, delta_buf, lbase, lsn, dbase, m, Nq, BN, t)
    for t in range(128):
        coords = w.acc_coords(t, BN)
        sv = np.array([s[r, c] for r, c in coords], np.float32)
        dv = np.array([dp[r, c] for r, c in coords], np.float32)
        warp, g, tq = t // 32, (t % 32) // 4, t % 4
        j0 = k0 + 16 * warp + g
        ls = np.zeros(BN // 4, np.float32)
        dl = np.zeros(BN // 4, np.float32)
        hb.read_stats.py_func(ls, dl, smem, e0, BN, NT, tq)
        s1, d1 = sv.copy(), dv.copy()
        gc = np.full(len(sv), np.nan, np.float32)
        hb.probs_t.py_func(sv, gc, ls, m, j0, causal_offset, sl2, mask or SMOD, True, -1, -1,
                           NT, tq, *um)
        hb.grads_t.py_func(sv, gc, dv, dl, NT, um[1] or SMOD)
        packed = np.zeros(BN // 4, np.uint32)
        hb.probs_grads_t.py_func(None, s1, d1, packed, packed.copy(), ls, dl, m, j0,
                                 causal_offset, sl2, mask or SMOD, True, -1, -1, NT, tq, *um)
        for x, (r, c) in enumerate(coords):
            out_p[r, c], out_ds[r, c] = sv[x], dv[x]
            one_p[r, c], one_ds[r, c] = s1[x], d1[x]
    qi = m + np.arange(BN)
    kj = k0 + np.arange(64)
    seen = (qi[:, None] < Nq) & (kj[None, :] <= qi[:, None] + causal_offset)
    if not mask:  # (inner and tail steps lie wholly below the diagonal)
        assert seen[qi < Nq].all()
    if SMOD:  # (and the mask_mod, on every step: the step functions' MASK)
        seen &= _user_seen(qi, kj, h)
    lq = np.where(qi < Nq, lse[qi], np.inf)
    sm, gm = _modded_reference(s.T.astype(np.float64), scale, *HOST_MODS[mods],
                               qi[:, None] + causal_offset - kj[None, :], qi, kj, h)
    p, ds = _reference(sm, lq, dp.T.astype(np.float64),
                       np.where(qi < Nq, delta[qi], 0.0), scale, seen)
    ds = ds * gm
    for got_p, got_ds in ((out_p, out_ds), (one_p, one_ds)):
        np.testing.assert_allclose(got_p, p.T, rtol=2e-5, atol=1e-30)
        np.testing.assert_allclose(got_ds, ds.T, rtol=2e-5, atol=1e-6)
    assert (out_p[:, 5] == 0).all()  # the row that sees no key
    if step == "tail":
        assert (out_p[:, Nq - m:] == 0).all()


@pytest.mark.parametrize("mods", list(HOST_MODS))
@pytest.mark.parametrize("BN", [64, 128])
@pytest.mark.parametrize("mask", [False, True])
def test_dq_step_on_the_host(on_host, BN, mask, mods):
    """S and dP in wgmma's accumulator layout (64 query rows x ``BN`` keys) become P and dS:
    per row its lse and delta; with the mask (a diagonal or tail tile, bottom-right causal
    with Nq != Nk) keys past Nk or after the diagonal get P = 0; the softcap and ALiBi."""
    rng = np.random.default_rng(BN + mask)
    scale = 0.09
    n0, q0 = 128, 64
    Nk = n0 + BN - 7 if mask else 1024
    causal_offset = 70 if mask else 4096  # (unmasked: every key of the tile is seen)
    s = rng.standard_normal((64, BN)).astype(np.float32) * 4  # queries x keys
    dp = rng.standard_normal((64, BN)).astype(np.float32)
    lse = (rng.standard_normal(64) * 2 + 3).astype(np.float32)
    delta = rng.standard_normal(64).astype(np.float32)
    sl2 = np.float32(scale * math.log2(math.e))
    out_p = np.full((64, BN), np.nan)
    out_ds = np.full((64, BN), np.nan)
    h = 2
    um = _host_mods(mods, scale, 0, h, 10 ** 6, Nk)
    SMOD = um[3]
    for t in range(128):
        coords = w.acc_coords(t, BN)
        sv = np.array([s[r, c] for r, c in coords], np.float32)
        dv = np.array([dp[r, c] for r, c in coords], np.float32)
        gc = np.full(len(sv), np.nan, np.float32)
        warp, g, tq = t // 32, (t % 32) // 4, t % 4
        r0 = 16 * warp + g
        for base, r in ((0, r0), (2, r0 + 8)):
            ls, dl = prologue.query_stats.py_func(lse, delta, r, r, True)
            hb.probs_row.py_func(sv, gc, base, ls, n0, q0 + r, Nk, causal_offset, sl2,
                                 mask or SMOD, True, -1, -1, BN // 8, tq, *um)
            hb.grads_row.py_func(sv, gc, dv, base, dl, BN // 8, um[1] or SMOD)
        for x, (r, c) in enumerate(coords):
            out_p[r, c], out_ds[r, c] = sv[x], dv[x]
    qi = q0 + np.arange(64)
    kj = n0 + np.arange(BN)
    seen = (kj[None, :] < Nk) & (kj[None, :] <= qi[:, None] + causal_offset)
    if mask:
        assert not seen.all() and seen.any()
    if SMOD:  # (and the mask_mod: the step functions' MASK)
        seen &= _user_seen(qi, kj, h)
    sm, gm = _modded_reference(s.astype(np.float64), scale, *HOST_MODS[mods],
                               qi[:, None] + causal_offset - kj[None, :], qi, kj, h)
    p, ds = _reference(sm, lse.astype(np.float64), dp.astype(np.float64),
                       delta.astype(np.float64), scale, seen)
    np.testing.assert_allclose(out_p, p, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(out_ds, ds * gm, rtol=2e-5, atol=1e-6)


def test_tilings_and_variants():
    for n, d, t, c in ALL:
        v = _variant(n, d, t, c)
        p = v.tiles.producer  # (dK/dV at D=64: hopper/backward_ws.py's layout)
        assert v.threads == 128 * (v.tiles.warpgroups + p)
        assert v.block_m == 64 * v.tiles.warpgroups
        if p:  # K and V, Q and dO in three stages, their statistics, the ring's barriers
            assert (n, d, v.tiles.stages) == ("dkdv", 64, 3), v.tag
            stats = -(-3 * 8 * 64 // tilings.HOPPER_ALIGN) * tilings.HOPPER_ALIGN  # (aligned)
            assert v.smem_words * 4 == tilings.HOPPER_ALIGN + (2 * v.block_m + 6 * 64) * d * 2 \
                + stats + 6 * 8
        else:
            stats = 16 * v.tiles.block_n if n == "dkdv" else 0  # (the steps' lse and delta)
            assert v.smem_words * 4 == tilings.HOPPER_ALIGN + (
                2 * v.block_m + 4 * v.tiles.block_n) * d * 2 + stats
        assert v.smem_words * 4 <= tilings.SMEM_LIMIT[(9, 0)]
        assert v.tag.startswith(f"attn_backward_{n}_wgmma_d{d}_")
        assert launch.hopper_variant(d, t, c, n) == v
    for n, t, d, c in _candidates():
        assert _variant(n, d, "bfloat16", c, t).smem_words * 4 <= tilings.SMEM_LIMIT[(9, 0)]
    for (d, c), pairs in tilings.HOPPER_BWD_CANDIDATES.items():  # the table's pair first
        assert pairs[0] == (tilings.choose_hopper(d, c, "dkdv"),
                            tilings.choose_hopper(d, c, "dq"))
    with pytest.raises(ValueError):
        Variant("preprocess", "hopper", 64, "bfloat16", False, tilings.HopperTiles(2, 64))
    with pytest.raises(ValueError):
        launch.build(Variant("dkdvq", "hopper", 64, "bfloat16", False,
                             tilings.HopperTiles(2, 64), alibi=True))


def _case(dtype="float16", D=64, **options):
    from flashcore._checks import make_case

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 40, D)).astype(dtype) for _ in range(3))
    full = {"window": None, "softcap": None, "alibi_slopes": None, "score_mod": None,
            "mask_mod": None, "mod_args": (), "block_mask": None}
    return make_case(q, k, v, causal=True, scale=None, layout="bhnd", explicit=True,
                     options={**full, **options} if options else None)


def _varlen_case(D=64, **options):
    """A case of a varlen call of two fp16 sequences with ``options``."""
    from flashcore._packed_checks import make_varlen_case

    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((50, 2, D)).astype(np.float16) for _ in range(3))
    cu = np.array([0, 20, 50], np.int32)
    full = {"window": None, "softcap": None, "alibi_slopes": None, "score_mod": None,
            "mask_mod": None, "mod_args": (), "block_mask": None}
    return make_varlen_case(q, k, v, cu, cu, max_seqlen_q=30, max_seqlen_k=30, causal=True,
                            scale=None, explicit=True, options={**full, **options})


def test_the_launch_picks_it_only_where_it_should(monkeypatch):
    monkeypatch.setattr(launch, "device_cc", lambda device: (9, 0))
    case = _case()
    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV):
        monkeypatch.delenv(name, raising=False)
    assert launch.hopper_bwd_serves(case, 0)  # by default
    monkeypatch.setenv(launch.HOPPER_BWD_ENV, "0")
    assert not launch.hopper_bwd_serves(case, 0)
    assert launch.hopper_serves(case, 0)  # (the forward stays)
    monkeypatch.setenv(launch.HOPPER_BWD_ENV, "1")
    monkeypatch.setenv(launch.HOPPER_ENV, "0")  # turns both off
    assert not launch.hopper_bwd_serves(case, 0)
    monkeypatch.delenv(launch.HOPPER_ENV)
    assert not launch.hopper_bwd_serves(_case(D=32), 0)
    assert launch.hopper_bwd_serves(_case(window=(8, 0)), 0)  # (a window: the wgmma kernels)
    assert launch.hopper_bwd_serves(_case(D=256), 0)  # (two dK/dV blocks per key tile)
    monkeypatch.setenv(launch.DETERMINISTIC_ENV, "0")  # the non-deterministic mode: no window
    assert launch.fused_backward(case, 0) and not launch.fused_backward(_case(window=(8, 0)), 0)
    assert not launch.fused_backward(_case(D=256), 0)  # (no two-pass dkdvq kernel)
    assert launch.hopper_variant(256, "bfloat16", False, "dkdvq") is None
    # the producer form (hopper/backward_ws.py) at D=64 and, on 32-query steps (64 spill
    # there), at D=128
    assert (launch.hopper_variant(64, "bfloat16", True, "dkdvq").tiles
            == tilings.HopperTiles(2, 64, True, stages=3, producer=True))
    assert (launch.hopper_variant(128, "bfloat16", False, "dkdvq").tiles
            == tilings.HopperTiles(2, 32, True, producer=True))
    # a producer warpgroup: the dkdvq and dkdv kernels' (dense rows without modifiers), at
    # head dims 64 and 128
    ws = tilings.HopperTiles(2, 64, True, producer=True)
    for kernel, d in (("dq", 64), ("dkdvq", 256), ("dkdv", 256)):
        with pytest.raises(ValueError):
            launch.build(Variant(kernel, "hopper", d, "bfloat16", False, ws))
    for bad in ({"window": (64, 0)}, {"softcap": 20.0}, {"packed": "varlen"}):
        with pytest.raises(ValueError):
            launch.build(Variant("dkdv", "hopper", 64, "bfloat16", False, ws, **bad))
    monkeypatch.delenv(launch.DETERMINISTIC_ENV)
    # the softcap, ALiBi and the user's mods: the wgmma kernels, deterministic
    assert launch.hopper_bwd_serves(_case(softcap=20.0), 0)
    assert launch.hopper_bwd_serves(_case(alibi_slopes=np.ones(2, np.float32)), 0)
    user = _case(score_mod=lambda s, b, h, i, j: s)
    assert launch.hopper_bwd_serves(user, 0)
    # (varlen rows with the user's mods too, their classes per sequence; and a user-mods
    # tiling keeps two buffers, an empty step being skipped)
    varlen_user = _varlen_case(score_mod=lambda s, b, h, i, j: s)
    assert launch.hopper_bwd_serves(varlen_user, 0)
    for kernel in ("dkdv", "dq"):
        var = launch.hopper_variant(64, "float16", True, kernel, packed="varlen",
                                    user=launch.mask_options(varlen_user)["user"])
        assert var is not None and var.tiles.stages == 2, kernel
    assert launch.hopper_bwd_serves(_varlen_case(softcap=5.0), 0)
    from flashcore.backends.numba_cuda.variant import UserMods

    monkeypatch.setitem(tilings.HOPPER_DQ, (128, True), tilings.HopperTiles(1, 64, True,
                                                                            stages=3))
    mods = UserMods(None, abs, ())
    assert launch.hopper_variant(128, "bfloat16", True, "dq").tiles.stages == 3
    assert launch.hopper_variant(128, "bfloat16", True, "dq", user=mods).tiles.stages == 2
    monkeypatch.undo()
    monkeypatch.setattr(launch, "device_cc", lambda device: (9, 0))
    monkeypatch.setenv(launch.DETERMINISTIC_ENV, "0")
    assert not launch.fused_backward(_case(softcap=20.0), 0)
    assert not launch.fused_backward(user, 0)
    monkeypatch.delenv(launch.DETERMINISTIC_ENV)
    # the softcap's backward tilings leave the forward's alone: with a mask_mod it keeps
    # the schedule without the overlap
    from flashcore.backends.numba_cuda.variant import UserMods

    for d in (64, 128):
        v = launch.hopper_variant(d, "bfloat16", False, softcap=20.0,
                                  user=UserMods(None, abs, ()))
        assert v.tiles == tilings.HOPPER_MASK_MOD, v.tag
    for cc in ((8, 0), (9, 1), (10, 0)):
        monkeypatch.setattr(launch, "device_cc", lambda device, cc=cc: cc)
        assert not launch.hopper_bwd_serves(case, 0), cc


# --- PTX for sm_90a, without a GPU --------------------------------------------------------

@pytest.fixture
def sm90(monkeypatch):
    """Device helpers are typed against the current GPU's compute capability; without one,
    answer 9.0 (the kernels are compiled for cc=(9, 0, "a"))."""
    import numba.cuda.dispatcher as nd

    monkeypatch.setattr(nd, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))


def _ptx_cases():
    out = [pytest.param(n, None, d, t, c, "", id=f"{n}-D{d}-{t}-{'causal' if c else 'full'}",
                        marks=() if (n, d, t, c) in CI else pytest.mark.slow)
           for n, d, t, c in ALL]
    out += [pytest.param(n, tt, d, "bfloat16", c, "",
                         id=f"{n}-{tt.tag}-D{d}-bfloat16-{'causal' if c else 'full'}",
                         marks=pytest.mark.slow) for n, tt, d, c in _candidates()]
    # varlen rows (each block's sequence from the offsets) at head dim 128, where the
    # registers are tightest: in CI; at 64, slow
    out += [pytest.param(n, None, d, t, c, "varlen",
                         id=f"{n}-D{d}-{t}-{'causal' if c else 'full'}-varlen",
                         marks=() if d == 128 else pytest.mark.slow)
            for n, d, t, c in (("dkdv", 128, "bfloat16", True), ("dq", 128, "float16", False),
                               ("dkdv", 64, "float16", False), ("dq", 64, "bfloat16", True))]
    # the non-deterministic mode's kernel (dQ's parts by atomics): the table's tilings
    out += [pytest.param("dkdvq", None, d, t, c, "",
                         id=f"dkdvq-D{d}-{t}-{'causal' if c else 'full'}",
                         marks=() if d == 128 else pytest.mark.slow)
            for d, t, c in ((128, "bfloat16", True), (64, "float16", False),
                            (128, "float16", False))]
    # and with a producer warpgroup (hopper/backward_ws.py), in CI
    ws = tilings.HopperTiles(2, 64, True, producer=True)
    out += [pytest.param("dkdvq", ws, 64, "bfloat16", c, "",
                         id=f"dkdvq-{ws.tag}-D64-bfloat16-{'causal' if c else 'full'}")
            for c in (False, True)]
    return out


@pytest.mark.parametrize("kernel,tiles,head_dim,dtype,causal,packed", _ptx_cases())
def test_ptx_sm90a(sm90, kernel, tiles, head_dim, dtype, causal, packed):
    from ptx_addresses import narrowed_addresses
    from test_numba_cuda_wgmma import _assembles_clean

    v = _variant(kernel, head_dim, dtype, causal, tiles)
    if packed:
        v = replace(v, packed=packed)
    sig = launch.signature(v.entry, dtype)
    ptx = compile_sm90a(v, sig)
    assert ".target sm_90a" in ptx
    bn = v.tiles.block_n
    # two score products (SS, N = block_n, k over D) and one (dQ) or two (dV, dK) RS
    # products (N = D, k over block_n), loops written out
    n_ss, n_rs = 2 * head_dim // 16, (1 if kernel == "dq" else 2) * bn // 16
    # (dK/dV at D=256: each of two blocks makes half of dK's and dV's columns)
    n_out = head_dim if kernel == "dq" else head_dim // tilings.dkdv_passes(head_dim)
    kind = "bf16" if dtype == "bfloat16" else "f16"
    n_dq = 0
    if kernel == "dkdvq":  # dQᵀ = Kᵀ dSᵀ: per 64 head dims, 4 k-steps per warpgroup's keys
        # (two warpgroups: each over both's keys, for half the step's queries), K M-major
        n_dq = 4 * v.tiles.warpgroups * head_dim // 64
        dq_shape = f"m64n{bn // v.tiles.warpgroups}k16.f32.{kind}.{kind}"
        assert "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32" in ptx
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert len(mma) == n_ss + n_dq + n_rs, f"{len(mma)} wgmma (loops left rolled?)"
    ss = [ln for ln in mma if ln.count("{") == 2]  # (RS: one brace more, A's registers)
    rs = [ln for ln in mma if ln.count("{") == 3]
    assert len(ss) == n_ss + n_dq and len(rs) == n_rs
    if n_dq:  # (the dQᵀ chains: A M-major, the trans-a flag 1)
        dqt = [ln for ln in ss if ln.rstrip().endswith("p, 1, 1, 1, 0; }")]
        assert len(dqt) == n_dq and all(dq_shape in ln for ln in dqt), dqt[:2]
        ss = [ln for ln in ss if ln not in dqt]
    assert all(f"m64n{bn}k16.f32.{kind}.{kind}" in ln for ln in ss)
    assert all(f"m64n{n_out}k16.f32.{kind}.{kind}" in ln for ln in rs)
    if v.tiles.overlap:  # P computed while dP runs
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
    assert "fence.proxy.async.shared::cta;" in ptx
    assert ".local" not in ptx, "register tiles went to local memory"
    assert narrowed_addresses(ptx) == []  # 64-bit addresses: tensors past 2^31 elements
    entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
    assert len(re.findall(r"\.param\s+\.\w+", entry.group(1))) == len(sig)
    _assembles_clean(ptx, SPILLS.get((kernel, head_dim, causal, v.tiles.tag), 0))


#: Bytes of stack and of spills ptxas may take, per (kernel, D, causal, tiling): the dK/dV
#: kernel's 64-query steps at D=128 causal, a 16-byte frame, 12 bytes stored and 28 loaded
#: (ptxas 13.0), faster than the 32-query steps without any (tilings.HOPPER_DKDV).
SPILLS = {("dkdv", 128, True, "g1n64o"): 28,
          # the producer dkdvq at D=128 causal: 8 bytes stored, 28 loaded (ptxas 13.0;
          # non-causal none)
          ("dkdvq", 128, True, "g2n32ow"): 28}


#: (kernel, D, dtype, causal, softcap, ALiBi, window) of the mods' PTX test; the first two
#: in CI (the registers are tightest in dK/dV at D=64 with both and a causal mask)
MOD_PTX = [("dkdv", 64, "bfloat16", True, 30.0, True, ()),
           ("dq", 128, "float16", False, 30.0, True, ()),
           ("dkdv", 128, "bfloat16", True, 20.0, True, (100, 0)),
           ("dkdv", 64, "float16", False, 0.0, True, ()),
           ("dkdv", 128, "float16", False, 5.0, False, ()),
           ("dq", 64, "bfloat16", True, 2.5, False, (64, 32)),
           ("dkdv", 128, "float16", False, 0.0, True, ()),
           ("dkdv", 128, "bfloat16", False, 20.0, True, (100, 30)),
           ("dkdv", 256, "bfloat16", True, 30.0, True, ()),
           ("dq", 256, "float16", False, 5.0, True, (64, 32))]


@pytest.mark.parametrize("kernel,head_dim,dtype,causal,softcap,alibi,window", [
    pytest.param(*x, id=f"{x[0]}-D{x[1]}-{x[2]}-{'causal' if x[3] else 'full'}-cap{x[4]}-"
                        f"alibi{int(x[5])}-w{'_'.join(map(str, x[6]))}",
                 marks=() if i < 2 else pytest.mark.slow) for i, x in enumerate(MOD_PTX)])
def test_ptx_sm90a_with_softcap_and_alibi(sm90, kernel, head_dim, dtype, causal, softcap,
                                          alibi, window):
    """The wgmma backward with the softcap and ALiBi compiles for sm_90a in the tiling the
    launch picks (at D=64 a softcap's own: tilings.HOPPER_BWD_SOFTCAP; at D=128 dK/dV's
    32-query steps: tilings.HOPPER_BWD_MASKED), the softcap's tanh
    approximate, with no local memory, no spills and no serialized wgmmas."""
    from test_numba_cuda_wgmma import _assembles_clean

    v = launch.hopper_variant(head_dim, dtype, causal, kernel, window=window, softcap=softcap,
                              alibi=alibi)
    assert v.softcap == softcap and v.alibi == alibi
    table = (tilings.HOPPER_DKDV if kernel == "dkdv" else tilings.HOPPER_DQ)[head_dim, causal]
    if kernel == "dkdv":  # (the producer form serves unmasked dense rows only)
        table = tilings.HOPPER_DKDV_ROWS.get((head_dim, causal), table)
    want = {("dkdv", 128): tilings.HopperTiles(1, 32, True),  # (64-query steps spill here)
            ("dq", 64): tilings.HopperTiles(1, 64, True) if softcap else table}
    assert v.tiles == want.get((kernel, head_dim), table), v.tag
    assert launch.hopper_variant(head_dim, dtype, causal, "dkdvq", softcap=softcap,
                                 alibi=alibi) is None  # (the deterministic kernels only)
    sig = launch.signature(v.entry, dtype)
    ptx = compile_sm90a(v, sig)
    assert ("tanh.approx.f32" in ptx) == bool(softcap)
    assert ".local" not in ptx, "register tiles went to local memory"
    _assembles_clean(ptx)


def _capped(s, b, h, i, j, table, doc):
    """The softcap as a score_mod (its tanh the approximate one at 16 bits)."""
    return 1.7 * math.tanh(s / 1.7)


#: score_mod, mask_mod of the user mods' PTX test
USER_MODS = {"rel+doc": (rel_bias, same_doc), "cap": (_capped, None), "doc": (None, same_doc)}
#: (kernel, D, dtype, causal, mods, rows) of the user mods' PTX test; the first two in CI
USER_PTX = [("dkdv", 64, "bfloat16", True, "rel+doc", ""), ("dq", 64, "float16", False, "doc", ""),
            ("dkdv", 128, "float16", False, "rel+doc", ""),
            ("dq", 128, "bfloat16", True, "rel+doc", ""),
            ("dkdv", 64, "float16", False, "cap", ""), ("dq", 128, "bfloat16", False, "cap", ""),
            ("dkdv", 256, "bfloat16", True, "rel+doc", ""), ("dq", 256, "float16", True, "doc", ""),
            ("dkdv", 64, "bfloat16", True, "rel+doc", "varlen"),
            ("dq", 128, "float16", True, "rel+doc", "varlen"),
            ("dkdv", 128, "float16", True, "rel+doc", "varlen")]
#: Bytes of stack and spills ptxas may take with the user's mods: how many registers a mod
#: holds is the user's; with these (a table and document ids read per score) ptxas 13.0
#: spills 8-84 bytes in a few causal kernels at D=128 and 256 (tilings.HOPPER_BWD_USER)
USER_SPILL = 96
#: The same with varlen rows (their sequence offsets held too): causal dK/dV at D=128
#: spills 148 bytes (120 before the class span's scan from each end, seams.class_span),
#: and D=256 76-116 (tilings.HOPPER_BWD_USER_VARLEN)
USER_SPILL_VARLEN = 152


@pytest.mark.parametrize("kernel,head_dim,dtype,causal,mods,rows", [
    pytest.param(*x, id=f"{x[0]}-D{x[1]}-{x[2]}-{'causal' if x[3] else 'full'}-{x[4]}"
                 + (f"-{x[5]}" if x[5] else ""),
                 marks=() if i < 2 else pytest.mark.slow) for i, x in enumerate(USER_PTX)])
def test_ptx_sm90a_with_user_mods(sm90, kernel, head_dim, dtype, causal, mods, rows):
    """The wgmma backward with the user's score_mod and mask_mod (and their arrays) compiles
    for sm_90a in the tiling the launch picks (tilings.HOPPER_BWD_USER at D=64), dense or
    varlen rows, the mods' arithmetic in float32, the wgmma counts of the kernel without
    them, no local memory and no serialized wgmmas; the non-deterministic mode's kernel
    takes no mods."""
    from flashcore.backends.numba_cuda.variant import UserMods
    from test_numba_cuda_wgmma import _assembles_clean

    sm, mm = USER_MODS[mods]
    user = UserMods(sm, mm, (("float32", 2), ("int32", 2)))
    v = launch.hopper_variant(head_dim, dtype, causal, kernel, user=user, packed=rows)
    assert v.user == user and v.tiles.stages == 2 and v.packed == rows
    want = tilings.HOPPER_BWD_USER.get((kernel, head_dim)) or tilings.choose_hopper(
        head_dim, causal, kernel, softcap=sm is not None, masked=True)
    if rows:
        want = tilings.HOPPER_BWD_USER_VARLEN.get((kernel, head_dim, causal), want)
    assert v.tiles == want, v.tag
    assert launch.hopper_variant(head_dim, dtype, causal, "dkdvq", user=user) is None
    plain = launch.hopper_variant(head_dim, dtype, causal, kernel, window=(64, 64),
                                  packed=rows)
    sig = launch.signature(v.entry, dtype, user.args)
    ptx = compile_sm90a(v, sig)
    base = compile_sm90a(replace(plain, tiles=v.tiles), launch.signature(v.entry, dtype))
    assert ptx.count("wgmma.mma_async") == base.count("wgmma.mma_async")
    assert "cvt.f64.f32" not in ptx
    assert ".local" not in ptx, "register tiles went to local memory"
    _assembles_clean(ptx, USER_SPILL_VARLEN if rows else USER_SPILL)


# --- on an H100/H200 ----------------------------------------------------------------------

def _check_grads(torch, grads, do, q, k, v, causal, layout, dtype):
    """``grads`` (dq, dk, dv on the GPU) against the float64 oracle, dtype and shape too;
    returns the oracle's gradients and their floors."""
    from helpers import TOL_BWD, grad_floor, oracle_backward, rel_err

    torch.cuda.synchronize()
    host = [x.float().cpu().numpy() for x in (do, q, k, v)]
    refs = oracle_backward(*host, causal=causal, layout=layout)
    floors = grad_floor(*host, causal=causal, layout=layout)
    for name, g, r, fl, x in zip(("dq", "dk", "dv"), grads, refs, floors, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        e = rel_err(g.float().cpu().numpy(), r, fl)
        assert e < TOL_BWD[dtype], f"{name}: {e}"
    return refs, floors


def _gpu():
    return hopper_gpu_or_skip("the wgmma backward")


#: (D, dtype, causal) of the table's tilings
TABLE = [(d, t, c) for d in (64, 128, 256) for t in ("bfloat16", "float16")
         for c in (False, True)]
#: (dK/dV tiles, dQ tiles, shape, D, dtype, causal): the table's pair (the first candidate)
#: on every shape, dtype, head dim and causal mode; the other candidate pairs in bf16 on the
#: first three shapes.
GPU_CASES = [(pair[0], pair[1], shape, d, t, c)
             for (d, c), pairs in tilings.HOPPER_BWD_CANDIDATES.items()
             for i, pair in enumerate(pairs) for shape in SHAPES
             for t in ("bfloat16", "float16")
             if i == 0 or (t == "bfloat16" and shape in SHAPES[:3])] if HAVE else []


@pytest.fixture(scope="module")
def hopper_bwd_gpu():
    """torch, once the variants the tests run are compiled in parallel processes (numba's
    disk cache): the wgmma dK/dV and dQ kernels, the mma.sync ones they are compared with,
    the forwards that make o and lse and the preprocess. Under pytest-xdist one worker
    compiles (a file lock, the forward's test's: one pool at a time), the others then load
    from the disk cache."""
    torch = _gpu()
    todo = set()
    for kt, qt, _, d, t, c in GPU_CASES:
        todo |= {_variant("dkdv", d, t, c, kt), _variant("dq", d, t, c, qt)}
    for d, t, c in TABLE:
        tc = launch.tc_variants(d, t, c, (9, 0), gpu=launch._gpu(0)[1])
        todo |= {x for x in tc if x.kernel in KERNELS}
        todo.add(launch.hopper_variant(d, t, c))
        kt = tilings.choose_simt(d, t, c, (9, 0))
        todo.add(launch.simt_variants(d, t, c, kt)[1])  # (the preprocess)
    for d, t, c, w, _ in WINDOW_CASES:  # the wgmma backward with a window
        todo |= {launch.hopper_variant(d, t, c, n, window=tuple(-1 if x is None else x
                                                                for x in w))
                 for n in KERNELS}
    for d, t, c, _, tiles in FUSED_CASES:  # the non-deterministic mode's two kernels
        todo |= {_variant("dkdvq", d, t, c, tiles),
                 Variant("dqconvert", "simt", d, t, False, 256)}
    compile_once(todo, "flashcore-hopper-bwd-test")
    return torch


@pytest.mark.gpu
@pytest.mark.parametrize("dkdv_tiles,dq_tiles,shape,head_dim,dtype,causal", [
    pytest.param(*x, id=f"{x[0].tag}-{x[1].tag}-{'x'.join(map(str, x[2]))}-D{x[3]}-{x[4]}-"
                        f"{'causal' if x[5] else 'full'}") for x in GPU_CASES])
def test_hopper_backward_on_gpu(hopper_bwd_gpu, monkeypatch, dkdv_tiles, dq_tiles, shape,
                                head_dim, dtype, causal):
    torch = hopper_bwd_gpu
    from helpers import TOL_BWD, rel_err

    import flashcore

    B, Hq, Hkv, Nq, Nk, layout = shape
    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setitem(tilings.HOPPER_DKDV, (head_dim, causal), dkdv_tiles)
    monkeypatch.setitem(tilings.HOPPER_DQ, (head_dim, causal), dq_tiles)
    monkeypatch.setattr(launch, "_PLANS", {})  # (plans do not key on the wgmma tilings)
    ran = spy_launches(monkeypatch)
    q, k, v, do = gpu_inputs(torch, shape, head_dim, dtype, Nq * 7 + Nk + head_dim + 1)
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                         backend="numba_cuda")
    grads = flashcore.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout,
                                         backend="numba_cuda")
    assert ran == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"], ran
    refs, floors = _check_grads(torch, grads, do, q, k, v, causal, layout, dtype)
    # bitwise deterministic: a second call gives the same bits
    again = flashcore.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout,
                                         backend="numba_cuda")
    assert all(torch.equal(a, b) for a, b in zip(grads, again))

    # and with the switch off, the mma.sync kernels (plans keyed by it, chosen per call)
    monkeypatch.setenv(launch.HOPPER_BWD_ENV, "0")
    grads2 = flashcore.attention_backward(do, q, k, v, o, lse, causal=causal, layout=layout,
                                          backend="numba_cuda")
    assert ran[-2:] == ["attn_backward_dkdv_tc", "attn_backward_dq_tc"], ran
    for name, g, r, fl in zip(("dq", "dk", "dv"), grads2, refs, floors):
        assert rel_err(g.float().cpu().numpy(), r, fl) < TOL_BWD[dtype], name


#: (D, dtype, causal, shape, tiles) of the non-deterministic mode's GPU test: the table's
#: tilings (None; the producer form at D=64 and 128), both dtypes, every shape at one of
#: each head dim and causal mode (and at D=64, on two shapes, the one-warpgroup dkdvq and
#: the producer form with two stages)
FUSED_CASES = [(d, t, c, shape, None) for d, t, c in TABLE for shape in SHAPES
               if d <= 128 and ((t == "bfloat16") == c or shape is SHAPES[0])] if HAVE else []
FUSED_CASES += [(64, dt, c, shape, tiles)  # (the table's at D=64: the producer, 3 stages)
                for tiles in (tilings.HopperTiles(1, 64, True),
                              tilings.HopperTiles(2, 64, True, producer=True))
                for dt, c, shape in (("bfloat16", True, SHAPES[1]),
                                     ("float16", False, SHAPES[2]))] if HAVE else []


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype,causal,shape,tiles", [
    pytest.param(*x, id=f"D{x[0]}-{x[1]}-{'causal' if x[2] else 'full'}-"
                        f"{'x'.join(map(str, x[3]))}" + (f"-{x[4].tag}" if x[4] else ""))
    for x in FUSED_CASES])
def test_fused_backward_on_gpu(hopper_bwd_gpu, monkeypatch, head_dim, dtype, causal, shape,
                               tiles):
    """``FLASHCORE_DETERMINISTIC=0``: one dkdvq kernel (dK, dV, and dQ by atomics into a
    float32 accumulator), against the float64 oracle; dK and dV bit for bit those of the
    deterministic mode (the same sums in the same order), dQ within the tolerance of it."""
    torch = hopper_bwd_gpu

    import flashcore

    B, Hq, Hkv, Nq, Nk, layout = shape
    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV):
        monkeypatch.delenv(name, raising=False)
    if tiles is not None:
        monkeypatch.setitem(tilings.HOPPER_DKDVQ, (head_dim, causal), tiles)
        monkeypatch.setattr(launch, "_PLANS", {})  # (plans do not key on the wgmma tilings)
    tags = spy_launches(monkeypatch, ("launch_dkdv",),
                         lambda kern: kern._dispatcher.py_func.__qualname__)
    q, k, v, do = gpu_inputs(torch, shape, head_dim, dtype, Nq * 5 + Nk + head_dim)
    opts = dict(causal=causal, layout=layout, backend="numba_cuda")
    o, lse = flashcore.attention_forward(q, k, v, **opts)
    det = flashcore.attention_backward(do, q, k, v, o, lse, **opts)
    monkeypatch.setenv(launch.DETERMINISTIC_ENV, "0")
    grads = flashcore.attention_backward(do, q, k, v, o, lse, **opts)
    assert tags[-1].startswith("attn_backward_dkdvq_wgmma"), tags
    assert tiles is None or f"_{tiles.tag}_" in tags[-1], tags
    _check_grads(torch, grads, do, q, k, v, causal, layout, dtype)
    assert torch.equal(grads[1], det[1]) and torch.equal(grads[2], det[2])


#: (D, dtype, causal, window, shape) of the windowed wgmma backward's GPU test: a left
#: window causal, a two-sided one, one wider than the keys, on tails, GQA and Nq != Nk
WINDOW_CASES = [(64, "bfloat16", True, (50, None), SHAPES[1]),
                (128, "bfloat16", False, (100, 30), SHAPES[0]),
                (128, "float16", True, (256, 0), SHAPES[3]),
                (64, "float16", False, (2000, None), SHAPES[2]),
                (256, "bfloat16", True, (100, None), SHAPES[1])] if HAVE else []


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype,causal,window,shape", [
    pytest.param(*x, id=f"D{x[0]}-{x[1]}-{'causal' if x[2] else 'full'}-w{x[3][0]}_{x[3][1]}-"
                        f"{'x'.join(map(str, x[4]))}") for x in WINDOW_CASES])
def test_window_backward_on_gpu(hopper_bwd_gpu, monkeypatch, head_dim, dtype, causal, window,
                                shape):
    """A sliding window on the wgmma backward (its query steps and key tiles cut to the
    window's range, the edge steps masked) against the float64 reference backend."""
    torch = hopper_bwd_gpu
    from helpers import TOL_BWD, rel_err

    import flashcore

    B, Hq, Hkv, Nq, Nk, layout = shape
    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV, launch.DETERMINISTIC_ENV):
        monkeypatch.delenv(name, raising=False)
    ran = spy_launches(monkeypatch)
    q, k, v, do = gpu_inputs(torch, shape, head_dim, dtype, Nq * 3 + Nk + head_dim)
    opts = dict(causal=causal, layout=layout, window=window)
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **opts)
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
    assert ran == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"], ran
    x64 = [x.double().cpu().numpy() for x in (do, q, k, v)]
    o64, lse64 = flashcore.attention_forward(*x64[1:], backend="reference", **opts)
    refs = flashcore.attention_backward(*x64, o64, lse64, backend="reference", **opts)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        e = rel_err(g.double().cpu().numpy(), r)
        assert e < TOL_BWD[dtype], f"{name}: {e}"


#: (D, dtype, causal, softcap, ALiBi slopes' shape, window, shape) of the wgmma backward's
#: softcap and ALiBi GPU test: each alone and together, with a window, on tails, GQA and
#: Nq != Nk, every head dim, both dtypes and causal modes
MOD_CASES = [(64, "bfloat16", True, 30.0, None, None, SHAPES[1]),
             (128, "float16", False, 5.0, None, None, SHAPES[0]),
             (128, "bfloat16", True, None, "bh", None, SHAPES[0]),
             (64, "float16", False, None, "h", None, SHAPES[2]),
             (128, "bfloat16", True, 20.0, "h", (100, 0), SHAPES[3]),
             (64, "bfloat16", False, 2.5, "bh", (64, 32), SHAPES[0]),
             (256, "float16", True, 20.0, "h", (100, 0), SHAPES[1]),
             (256, "bfloat16", False, 30.0, "bh", None, SHAPES[0])] if HAVE else []


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,dtype,causal,softcap,alibi,window,shape", [
    pytest.param(*x, id=f"D{x[0]}-{x[1]}-{'causal' if x[2] else 'full'}-cap{x[3]}-"
                        f"alibi{x[4]}-w{x[5]}-{'x'.join(map(str, x[6]))}") for x in MOD_CASES])
def test_softcap_and_alibi_backward_on_gpu(hopper_bwd_gpu, monkeypatch, head_dim, dtype,
                                           causal, softcap, alibi, window, shape):
    """The softcap (dS times 1 - tanh^2) and ALiBi on the wgmma backward, with and without
    a window, against the float64 reference backend; the deterministic mode is kept for
    them (the dkdvq kernel takes neither)."""
    torch = hopper_bwd_gpu
    from helpers import TOL_BWD, rel_err

    import flashcore

    B, Hq, Hkv, Nq, Nk, layout = shape
    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(launch.DETERMINISTIC_ENV, "0")  # (not taken with these mods)
    ran = spy_launches(monkeypatch)
    q, k, v, do = gpu_inputs(torch, shape, head_dim, dtype, Nq * 5 + Nk + head_dim + 3)
    rng = np.random.default_rng(Nq + head_dim)
    slopes = (None if alibi is None else
              rng.uniform(0.01, 0.5, (Hq,) if alibi == "h" else (B, Hq)).astype(np.float32))
    opts = dict(causal=causal, layout=layout, window=window, softcap=softcap)
    o, lse = flashcore.attention_forward(
        q, k, v, backend="numba_cuda", **opts,
        alibi_slopes=None if slopes is None else torch.from_numpy(slopes).cuda())
    grads = flashcore.attention_backward(
        do, q, k, v, o, lse, backend="numba_cuda", **opts,
        alibi_slopes=None if slopes is None else torch.from_numpy(slopes).cuda())
    assert ran == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"], ran
    x64 = [x.double().cpu().numpy() for x in (do, q, k, v)]
    o64, lse64 = flashcore.attention_forward(*x64[1:], backend="reference", **opts,
                                             alibi_slopes=slopes)
    refs = flashcore.attention_backward(*x64, o64, lse64, backend="reference", **opts,
                                        alibi_slopes=slopes)
    for name, g, r, x in zip(("dq", "dk", "dv"), grads, refs, (q, k, v)):
        assert g.dtype == x.dtype and g.shape == x.shape
        e = rel_err(g.double().cpu().numpy(), r)
        assert e < TOL_BWD[dtype], f"{name}: {e}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,causal", [("bfloat16", True), ("float16", False)])
def test_head_dim_256_autograd_takes_the_wgmma_kernels(monkeypatch, dtype, causal):
    """At D=256 the wgmma forward and the wgmma backward serve (dK/dV in two blocks per key
    tile, each half of the columns: tilings.dkdv_passes); torch autograd through them, GQA,
    against the float64 oracle."""
    torch = _gpu()
    from helpers import TOL_FWD, oracle_forward, rel_err

    import flashcore

    for name in (launch.HOPPER_ENV, launch.HOPPER_BWD_ENV, launch.DETERMINISTIC_ENV):
        monkeypatch.delenv(name, raising=False)
    ran = spy_launches(monkeypatch, ("launch_forward", "launch_dkdv", "launch_dq"))
    shape = SHAPES[0]
    B, Hq, Hkv, Nq, Nk, layout = shape
    q, k, v, do = gpu_inputs(torch, shape, 256, dtype, 256 + Nq)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    o = flashcore.attention(*leaves, causal=causal, layout=layout, backend="numba_cuda")
    o.backward(do)
    assert ran == ["attn_forward_wgmma", "attn_backward_dkdv_wgmma",
                   "attn_backward_dq_wgmma"], ran
    ref_o, _ = oracle_forward(*(x.float().cpu().numpy() for x in (q, k, v)), causal=causal,
                              layout=layout)
    assert rel_err(o.detach().float().cpu().numpy(), ref_o) < TOL_FWD[dtype]
    _check_grads(torch, [x.grad for x in leaves], do, q, k, v, causal, layout, dtype)
