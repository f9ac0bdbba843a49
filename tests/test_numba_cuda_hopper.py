"""The sm_90a forward with wgmma (backends/numba_cuda/hopper/forward.py).

- Host side (any machine with numba-cuda): the swizzled tiles the kernel's copies write,
  read back at every k-step through the PTX ISA's canonical layouts (the transcription in
  test_numba_cuda_wgmma.py) with the kernel's descriptors, give Q, K and V; P's packed
  registers are wgmma's A fragments; the launch picks the kernel only where it should.
- Without a GPU: the variants compile for sm_90a (compile_ptx, cc=(9, 0, "a")) with
  wgmma.mma_async, no local memory, the launch's parameter list; where ptxas is installed
  it assembles them with no spills and no injected warpgroup.arrive (C7519).
- On an H100/H200 (marked ``gpu``, cc 9.0 only), where it serves by default: the kernel in
  the table's tiling on every case and in each other candidate tiling on a few (that it ran
  is checked) against the float64 oracle, outputs poisoned first (conftest); then the
  mma.sync kernel with FLASHCORE_HOPPER=0.
"""
from __future__ import annotations

import importlib.util
import os
import re
import types as pytypes

import numpy as np
import pytest
from hopper_helpers import (
    SHAPES,
    compile_once,
    compile_sm90a,
    gpu_inputs,
    hopper_gpu_or_skip,
    no_persistent,
    spy_launches,
)

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")
pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                       reason="numba-cuda is not installed"),
    pytest.mark.skipif(SIM, reason="wgmma has no CUDA-simulator form"),
]

if not SIM and importlib.util.find_spec("numba_cuda") is not None:
    from flashcore.backends.numba_cuda import launch, tilings
    from flashcore.backends.numba_cuda.device import wgmma as w
    from flashcore.backends.numba_cuda.hopper import forward as hf
    from flashcore.backends.numba_cuda.variant import Variant

#: Every (head dim, dtype, causal) the kernel serves; CI compiles the first four, one per
#: head dim and causal mode with both dtypes (the others are marked slow).
ALL = [(d, t, c) for d in tilings.HOPPER_HEAD_DIMS for t in ("bfloat16", "float16")
       for c in (False, True)] if not SIM and importlib.util.find_spec("numba_cuda") else []
CI = {(64, "bfloat16", False), (64, "float16", True), (128, "float16", False),
      (128, "bfloat16", True)}
#: The tilings the tool times (v1's schedule first, the table's), and per overlapped one the
#: case CI compiles: those the launch picks (the table's: at D=128 and D=64 non-causal the
#: producer warpgroup with bulk tensor copies, g2n128op3wt; the ping-pong one the softcap
#: takes, g2n128op3; the overlapped ones other masks take), the producer warpgroup's with
#: cp.async copies (setmaxnreg) and the persistent one's (a kernel of its own,
#: hopper/persistent.py); the other candidates, which lost on the H100 or H200, are left
#: to ``nox -s tests-cuda-compile`` (slow).
TILINGS = tilings.HOPPER_CANDIDATES if ALL else ()
CI_OVERLAP = {"g2n128o": {(128, "bfloat16", False)},
              "g2n64o": {(64, "bfloat16", False), (256, "bfloat16", True)},
              "g1n64ob2": {(64, "float16", True)},
              "g2n128op3": {(128, "bfloat16", True)}, "g2n128op3w": {(128, "float16", False)},
              "g2n64op2": {(256, "float16", False)}, "g2n128op2wts": {(128, "bfloat16", False)},
              "g2n128op2wtsy": {(128, "float16", True)},
              "g2n128op3wt": {(128, "bfloat16", False)}, "g2n192op3wt": {(64, "bfloat16", False)},
              "g1n128ob3": {(64, "bfloat16", False), (64, "float16", True)}}


def _in_ci(t, case):
    return case in CI if not t.overlap else case in CI_OVERLAP.get(t.tag, ())


def _variant(d, dtype, causal, t=None):
    return Variant("forward", "hopper", d, dtype, causal, t or tilings.choose_hopper(d, causal))


# --- host side ----------------------------------------------------------------------------

def _tile_image(monkeypatch, rows, D, nvalid, nt, e0, n0=0):
    """Run ``load_tile`` (``load_rows`` of a whole tile) on the host for every thread of a
    block of ``nt`` (rows ``n0 ..`` of a source whose rows below ``nvalid`` exist): returns
    the elements it places,
    ``{smem element index: (tile row, column)}``, and the zero-filled ones."""
    placed, zeros = {}, set()

    def fake_copy(smem, so, src, gidx, nbytes):
        for x in range(8):
            assert so + x not in placed and so + x not in zeros, "two copies to one place"
            if nbytes == 16:
                row, col = divmod(gidx + x, 1000)  # (source rows 1000 elements apart)
                assert row < nvalid, f"row {row} read, only {nvalid} exist"
                placed[so + x] = (row - n0, col)
            else:
                zeros.add(so + x)

    monkeypatch.setattr(hf, "cp_async16", fake_copy)
    for tid in range(nt):
        hf.load_rows.py_func(None, e0, None, 0, n0, nvalid, 1000, rows, rows, D // 8, tid, nt)
    return placed, zeros


def _canonical():
    from test_numba_cuda_wgmma import _canonical as canonical

    return canonical


@pytest.mark.parametrize("rows,D,nvalid,n0,nt", [
    (128, 64, 128, 0, 256), (128, 128, 77, 0, 256), (64, 128, 64, 0, 256),
    # one warpgroup's copies (8 rows a pass at D=128: the shared spot's constant-step path;
    # 4 at D=256: the general one), tiles further down, whole or cut by the end
    (128, 128, 128, 0, 128), (128, 128, 300, 256, 128), (64, 64, 1000, 320, 128),
    (64, 64, 333, 320, 128), (64, 256, 50, 0, 128), (128, 256, 1000, 128, 128)])
@pytest.mark.parametrize("pad", [0, 48])  # where the dynamic shared memory starts
def test_tiles_read_back_through_the_descriptors(monkeypatch, rows, D, nvalid, n0, nt, pad):
    """The copies place a ``rows x D`` tile as ``wgmma.tile_offset`` says (rows past
    ``nvalid`` zero, and not read), from the aligned start whatever the array's own start;
    the kernel's K-major descriptors (Q, K) and MN-major ones (V) read its k-steps back
    right."""
    canonical = _canonical()
    e0 = pad // 2 + 512  # the tile: 1024 bytes into the aligned region
    placed, zeros = _tile_image(monkeypatch, rows, D, nvalid, nt, e0, n0)
    nvalid -= n0  # rows of the tile that exist
    assert len(placed) + len(zeros) == rows * D
    at = {rc: 2 * (i - pad // 2) for i, rc in placed.items()}  # bytes from the aligned start
    for r in range(rows):
        for c in range(D):
            if r < nvalid:
                assert at[r, c] == 1024 + w.tile_offset(r, c, rows, D, w.SWIZZLE_128B)
    # K-major (S = Q Kᵀ, A and Bᵀ): 64-row sub-tiles from row 64 wg, 16 columns a k-step
    for wg in range(rows // 64):
        for kk in range(D // 16):
            start = 1024 + 64 * wg * hf.LINE + hf.k_start.py_func(kk, rows)
            for i in range(64):
                for k in range(16):
                    r, c = 64 * wg + i, 16 * kk + k
                    if r < nvalid:
                        assert canonical("k", 1, start, 16, hf.PATTERN, i, k) == at[r, c]
    # MN-major (O += P V, B = V): k = the tile's rows, n = its columns
    for kk in range(rows // 16):
        start = 1024 + 16 * kk * hf.LINE
        for k in range(16):
            for n in range(D):
                if 16 * kk + k < nvalid:
                    assert canonical("mn", 1, start, rows * hf.LINE, hf.PATTERN, k, n) == \
                        at[16 * kk + k, n]


def test_p_registers_are_the_a_fragments():
    """``pf[4 kk + r] = pack(s[8 kk + 2 r], s[8 kk + 2 r + 1])`` with ``s`` in wgmma's
    accumulator order holds the A fragment of k-step ``kk`` of ``P V`` (wgmma.a_coords)."""
    for t in range(128):
        acc = w.acc_coords(t, 128)  # S of 128 keys: (row, key) of s[x]
        frag = w.a_coords(t)  # (row, k) of A's 8 halves, register by register
        for kk in range(8):
            for r in range(4):
                lo, hi = acc[8 * kk + 2 * r], acc[8 * kk + 2 * r + 1]
                assert (lo[0], lo[1] - 16 * kk) == frag[2 * r]
                assert (hi[0], hi[1] - 16 * kk) == frag[2 * r + 1]


@pytest.mark.parametrize("D,BM,wg,nvalid", [(64, 128, 0, 128), (128, 128, 1, 100),
                                            (256, 64, 0, 37), (128, 64, 0, 64)])
def test_epilogue_rows_through_shared_memory(monkeypatch, D, BM, wg, nvalid):
    """``epilogue.store_o``, its 128 threads run as Python threads (its two barriers real):
    every row below ``nvalid`` lands in place, scaled per row and rounded as ``pack``
    rounds (bit for bit ``store_frags``'s rounding), rows past it untouched; the staging
    stores of each warp instruction hit 32 distinct banks, and each quarter-warp's 16-byte
    reads 8 distinct 16-byte slots (no bank conflicts), within this warpgroup's lines of
    the ``BM``-line tile."""
    import threading

    from flashcore.backends.numba_cuda.hopper import epilogue as ep

    rng = np.random.default_rng(D + BM + wg)
    sn, w_row = D + 24, 5  # (rows of the output: a stride past D; the warpgroup's first)
    rows = 64 * (wg + 1) + w_row + 8
    acc = rng.standard_normal((64, D)).astype(np.float32)  # the warpgroup's rows
    inv = rng.uniform(0.5, 2.0, 64).astype(np.float32)
    obase = 8 * 3  # (16-byte aligned)
    out = np.full(obase + rows * sn, 0xDEAD, np.uint16)
    e0 = 64  # the tile's first element in shared memory
    smem = np.zeros(e0 + BM * D, np.uint16)
    bar = threading.Barrier(128)
    stores, loads = [], []

    def pack(bf16, lo, hi):
        from flashcore.backends.numba_cuda.device.intrinsics import float_to_bits

        return np.uint32(float_to_bits(lo, "bf16") | (float_to_bits(hi, "bf16") << 16))

    def st_u32(sm, i, bits):
        stores.append((threading.get_ident(), int(i)))
        sm[int(i):int(i) + 2] = np.array([bits], np.uint32).view(np.uint16)

    def copy16(dst, di, src, si):
        assert di % 8 == 0 and si % 8 == 0
        loads.append((threading.get_ident(), int(si)))
        dst[di:di + 8] = src[si:si + 8]

    monkeypatch.setattr(ep, "pack", pack)
    monkeypatch.setattr(ep, "st_shared_u32", st_u32)
    monkeypatch.setattr(ep, "copy16", copy16)
    monkeypatch.setattr(ep, "wg_barrier", lambda g: bar.wait())
    errors = []

    def thread(t):
        try:
            coords = w.acc_coords(t, D)  # (row, column) of oa[x] in the warpgroup's rows
            oa = np.array([acc[r, c] for r, c in coords], np.float32)
            warp, g, tq = t // 32, (t % 32) // 4, t % 4
            i = w_row + 64 * wg + 16 * warp + g
            ep.store_o.py_func(True, smem, e0, out, obase, w_row + 64 * wg, i, nvalid, sn, 1,
                               oa, inv[16 * warp + g], inv[16 * warp + g + 8], D, BM, wg,
                               warp, g, tq, t)
        except Exception as e:  # noqa: BLE001
            errors.append(e)
            bar.abort()

    threads = [threading.Thread(target=thread, args=(t,)) for t in range(128)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[0]
    got = out[obase:obase + rows * sn].reshape(rows, sn)
    from flashcore.backends.numba_cuda.device.intrinsics import float_to_bits

    for r in range(64):
        row = w_row + 64 * wg + r
        if row < nvalid:
            want = [float_to_bits(np.float32(acc[r, c] * inv[r]), "bf16") for c in range(D)]
            assert list(got[row, :D]) == want, row
        else:
            assert (got[row] == 0xDEAD).all(), row
        assert (got[row, D:] == 0xDEAD).all()  # (nothing past the row's D columns)
    # the staging stores, by warp instruction (the threads' stores in order, 32 lanes a
    # warp): 32 distinct banks, in the warpgroup's lines (64 wg .. 64 wg + 63 of each
    # 64-column block)
    by_thread = {}
    for ident, i in stores:
        by_thread.setdefault(ident, []).append(i)
    idents = [th.ident for th in threads]
    n = len(by_thread[idents[0]])
    for warp in range(4):
        for k in range(n):
            idx = [by_thread[idents[32 * warp + lane]][k] for lane in range(32)]
            assert len({(i // 2) % 32 for i in idx}) == 32, (warp, k)
            assert all(64 * wg <= (i - e0) % (BM * 64) // 64 < 64 * wg + 64 for i in idx)
    by_thread = {}
    for ident, i in loads:
        by_thread.setdefault(ident, []).append(i)
    for q in range(16):  # quarter-warps: 8 lanes, 16 bytes each
        lanes = [idents[8 * q + x] for x in range(8)]
        for k in range(min(len(by_thread.get(x, [])) for x in lanes)):
            assert len({by_thread[x][k] // 8 % 8 for x in lanes}) == 8, (q, k)


def test_exp2_on_the_fma_pipe():
    """``exp2_fma`` (every ``poly``-th n-tile's exponentials, off the MUFU unit), as the
    host model computes it operation by operation in float32: within 3e-7 of 2^x from
    2^-126 up (``ex2.approx.f32``'s class), exactly 0 below it and at -inf (masked scores,
    rows that see no key), NaN kept; the PTX carries the model's constants."""
    from flashcore.backends.numba_cuda.device import intrinsics as intr

    x = np.concatenate([np.linspace(-126, 1, 400_001, dtype=np.float32),
                        np.float32([0.5, -0.5, -0.25, 0.0, -1e-30])])
    got = intr.exp2_fma_model(x).astype(np.float64)
    want = np.exp2(x.astype(np.float64))
    assert np.max(np.abs(got / want - 1)) < 3e-7
    assert np.all(intr.exp2_fma_model(np.float32([-126.01, -200, -np.inf])) == 0)
    assert np.isnan(intr.exp2_fma_model(np.float32([np.nan]))).all()
    hexes = {intr._f32_hex(c) for c in (*intr.EXP2_POLY, intr.EXP2_FLOOR, intr.ROUND_MAGIC)}
    assert all(h in intr._EXP2_PTX for h in hexes)
    assert intr._EXP2_PTX.count("fma.rn.f32") == len(intr.EXP2_POLY) - 1
    with pytest.raises(ValueError):
        tilings.HopperTiles(2, 128, True, poly=1)
    cap = launch.hopper_variant(128, "bfloat16", False, softcap=30.0)
    assert cap.tiles.poly == tilings.SOFTCAP_POLY and cap.tiles.pingpong
    # the exponentials stay on the MUFU unit but for the softcap: a window in the
    # persistent kernel (WINDOW_PERSISTENT) or, with other mods, the overlapped schedule,
    # ALiBi in ping-pong (since 2026-11-27)
    v = launch.hopper_variant(128, "bfloat16", True, window=(512, 511))
    assert v.tiles.persistent and not v.tiles.poly, v.tag
    v = launch.hopper_variant(128, "bfloat16", True, window=(512, 511), tma_ok=False)
    assert v.tiles.overlap and not v.tiles.pingpong and not v.tiles.poly, v.tag
    v = launch.hopper_variant(128, "bfloat16", True, alibi=True)
    assert v.tiles.pingpong and not v.tiles.poly, v.tag


def test_tilings_and_variants():
    for d, t, c in ALL:
        v = _variant(d, t, c)
        assert (v.threads == 128 * (v.tiles.warpgroups + v.tiles.producer)
                and v.block_m == 64 * v.tiles.warpgroups)
        assert v.smem_words * 4 <= tilings.SMEM_LIMIT[(9, 0)]
        assert v.tag.startswith(f"attn_forward_wgmma_d{d}_")
    with pytest.raises(ValueError):
        Variant("preprocess", "hopper", 64, "bfloat16", False, tilings.HopperTiles(2, 128))


def test_small_calls_keep_the_copies_of_the_consumers(monkeypatch):
    """Below tilings.TMA_MIN_WORK a forward whose table tiling has bulk tensor copies takes
    NO_TMA's tiling; from it, the table's, or PERSISTENT's for a dense batch without
    masks, VARLEN_PERSISTENT's for varlen rows (one tensor map over every packed row),
    WINDOW_PERSISTENT's for a window alone."""
    d = 128  # (D=64's table has no copies: below)
    t = tilings.HOPPER_FORWARD[(d, False)]
    assert t.tma and not t.persistent
    ps = tilings.PERSISTENT[(d, False)]
    assert ps.persistent and ps.tma
    assert launch.hopper_variant(d, "bfloat16", False).tiles == ps
    pc = tilings.PERSISTENT[(d, True)]  # (causal: the tiles from a counter)
    assert pc.persistent and pc.dynamic and not ps.dynamic
    assert launch.hopper_variant(d, "bfloat16", True).tiles == pc
    # a window alone: WINDOW_PERSISTENT's (with the copies, dense rows), else WINDOW_TILES'
    for c in (False, True):
        w = dict(window=(100, 0))
        assert launch.hopper_variant(d, "bfloat16", c, **w).tiles == \
            tilings.WINDOW_PERSISTENT[d]
        for kw in ({"tma_ok": False}, {"packed": "varlen"}, {"softcap": 30.0},
                   {"alibi": True}):
            assert not launch.hopper_variant(d, "bfloat16", c, **w, **kw).tiles.persistent
        assert launch.hopper_variant(d, "bfloat16", c, **w, softcap=30.0).tiles == \
            tilings.WINDOW_TILES[d]
        assert launch.hopper_variant(d, "bfloat16", c, "dkdv", **w).tiles == \
            launch.hopper_variant(d, "bfloat16", c, "dkdv", window=(100, 0), alibi=True).tiles
    assert launch.hopper_variant(d, "bfloat16", False, alibi=True).tiles == t
    assert launch.hopper_variant(d, "bfloat16", False, tma_ok=False).tiles == \
        tilings.NO_TMA[d]
    # varlen rows: VARLEN_PERSISTENT's, the tile counter causal, the static walk (as the
    # dense batch's) non-causal; with a window the table's
    assert launch.hopper_variant(d, "bfloat16", False, packed="varlen").tiles == ps
    assert tilings.VARLEN_PERSISTENT_TRIAL.dynamic
    assert tilings.VARLEN_PERSISTENT[(d, True)] == tilings.VARLEN_PERSISTENT_TRIAL
    assert tilings.VARLEN_PERSISTENT[(d, False)] == ps
    assert launch.hopper_variant(d, "bfloat16", True, packed="varlen").tiles == \
        tilings.VARLEN_PERSISTENT_TRIAL
    assert launch.hopper_variant(d, "bfloat16", True, packed="varlen", tma_ok=False).tiles \
        == tilings.NO_TMA[d]
    for c in (False, True):
        assert launch.hopper_variant(d, "bfloat16", c, packed="varlen").tiles == \
            tilings.VARLEN_PERSISTENT.get((d, c), t)
        assert launch.hopper_variant(d, "bfloat16", c, packed="varlen",
                                     window=(100, 0)).tiles == \
            launch.hopper_variant(d, "bfloat16", c, window=(100, 0), softcap=30.0).tiles
    assert launch.hopper_variant(d, "bfloat16", False, packed="varlen",
                                 tma_ok=False).tiles == tilings.NO_TMA[d]
    assert not tilings.NO_TMA[d].tma
    # D=64's table (three blocks of one warpgroup a SM) has no copies to leave out: small
    # calls, varlen rows, the softcap and ALiBi keep it; a window takes WINDOW_TILES'
    for c in (False, True):
        t = tilings.HOPPER_FORWARD[(64, c)]
        assert not t.tma and t.min_blocks == 3
        for kw in ({}, {"tma_ok": False}, {"packed": "varlen"}, {"alibi": True},
                   {"softcap": 30.0}, {"softcap": 30.0, "alibi": True}):
            assert launch.hopper_variant(64, "bfloat16", c, **kw).tiles == t, kw
        assert launch.hopper_variant(64, "bfloat16", c, window=(100, 0)).tiles == \
            tilings.WINDOW_TILES[64]
    # at D=128 a softcap or ALiBi keeps the ping-pong tilings (the softcap on tiles of at
    # most SOFTCAP_KEYS keys), small calls the consumers' copies; a score_mod with them
    # takes the overlapped MASKED_OVERLAP
    for c in (False, True):
        t = launch.hopper_variant(128, "bfloat16", c, softcap=30.0).tiles
        assert t.pingpong and t.block_n <= tilings.SOFTCAP_KEYS, t
        assert launch.hopper_variant(128, "bfloat16", c, alibi=True).tiles == \
            tilings.HOPPER_FORWARD[(128, c)]
        assert launch.hopper_variant(128, "bfloat16", c, alibi=True, tma_ok=False).tiles \
            == tilings.NO_TMA[128]
        assert tilings.masked_tiles(tilings.HOPPER_FORWARD[(128, c)], score_mod=True,
                                    head_dim=128, alibi=True) == tilings.MASKED_OVERLAP[128]
    # long key sequences (with the copies, no masks): LONG_KEYS' tiling where it has one
    for (d, c), t in tilings.LONG_KEYS.items():
        assert launch.hopper_variant(d, "bfloat16", c, long_keys=True).tiles == t
        for mask in ({"softcap": 30.0}, {"alibi": True}, {"window": (100, 0)}):
            assert launch.hopper_variant(d, "bfloat16", c, long_keys=True, **mask) == \
                launch.hopper_variant(d, "bfloat16", c, **mask), mask
        assert launch.hopper_variant(d, "bfloat16", c).tiles == \
            tilings.choose_hopper(d, c, dense=True)
        assert launch.hopper_variant(d, "bfloat16", c, long_keys=True, tma_ok=False) == \
            launch.hopper_variant(d, "bfloat16", c, tma_ok=False)
    # which calls may: the work B Hq Nq Nk D (B=4 H=16 N=4096 D=64 is 2^36), views that
    # can be tensor maps (no zero stride: a broadcast), a stream not being captured
    def case(B, H, N, D, varlen=None):
        return pytypes.SimpleNamespace(batch=B, heads_q=H, heads_kv=H, seqlen_q=N,
                                       seqlen_k=N, head_dim=D, varlen=varlen)

    def view(B, H, N, D, sh=None):
        return (0, (H * N * D, N * D if sh is None else sh, D, 1))

    capturing = []
    monkeypatch.setattr(launch.driver, "stream_capturing", lambda stream: bool(capturing))
    big, small = (4, 16, 4096, 64), (1, 8, 1024, 128)
    assert launch.bulk_copies_ok(case(*big), 0, *(view(*big),) * 3)
    assert not launch.bulk_copies_ok(case(*small), 0, *(view(*small),) * 3)
    assert not launch.bulk_copies_ok(case(*big), 0, view(*big), view(*big, sh=0), view(*big))
    # varlen: the packed query rows times the longest key sequence (4 heads, D=64, 16
    # sequences of at most 4096 keys: 2^36 with 2^16 query rows, 2^35 with 2^15)
    def packed(total):
        return case(16, 4, 4096, 64, pytypes.SimpleNamespace(total_q=total, total_k=total))

    rows = (0, (0, 64, 16 * 64, 1))
    assert launch.bulk_copies_ok(packed(1 << 16), 0, *(rows,) * 3)
    assert not launch.bulk_copies_ok(packed(1 << 15), 0, *(rows,) * 3)
    capturing.append(True)
    assert not launch.bulk_copies_ok(case(*big), 0, *(view(*big),) * 3)


def test_pingpong_tilings_and_rings():
    """The ping-pong option's checks, tags and shared memory (its rings and 4 mbarriers a
    stage); the ring's stage and phase parities over several laps."""
    from flashcore.backends.numba_cuda.device import pipeline as pl

    t = tilings.HopperTiles(2, 128, True, pingpong=True, stages=3)
    assert t.tag == "g2n128op3" and tilings.HopperTiles(2, 128, True).stages == 2
    assert tilings.hopper_smem_bytes(t, 128) == 1024 + (128 + 6 * 128) * 256 + 96
    assert tilings.hopper_smem_bytes(t, 128) <= tilings.SMEM_LIMIT[(9, 0)]
    for bad in ({"warpgroups": 1}, {"overlap": False}):
        with pytest.raises(ValueError):
            tilings.HopperTiles(**{"warpgroups": 2, "block_n": 64, "overlap": True,
                                   "pingpong": True, "stages": 3, **bad})
    with pytest.raises(ValueError):
        tilings.HopperTiles(2, 64, True, stages=4)  # (rings of 4: the ping-pong's only)
    # stages 3 without the ping-pong: a backward kernel's streamed tiles in three buffers
    # (its step's last products retire under the next step); the overlapped forward
    # double-buffers and refuses it
    d3 = tilings.HopperTiles(1, 64, True, stages=3)
    assert d3.tag == "g1n64od3"
    assert tilings.hopper_smem_bytes(d3, 64, "dkdv") == 1024 + (2 * 64 + 6 * 64) * 128 + 1024
    assert tilings.hopper_smem_bytes(d3, 64, "dq") == 1024 + (2 * 64 + 5 * 64) * 128
    from flashcore.backends.numba_cuda.hopper.forward import make_attn_forward_wgmma

    with pytest.raises(ValueError, match="double-buffers"):
        make_attn_forward_wgmma(Variant("forward", "hopper", 64, "bfloat16", False, d3))
    # a producer warpgroup: the ping-pong forward's, or the backward's dkdvq with two
    # overlapped consumer warpgroups (hopper/backward_ws.py); own_dq is that one's only
    assert tilings.HopperTiles(2, 64, True, producer=True).tag == "g2n64ow"
    assert tilings.HopperTiles(2, 64, True, producer=True, own_dq=True).tag == "g2n64owi"
    for bad in ({"warpgroups": 1}, {"overlap": False}, {"min_blocks": 2}):
        with pytest.raises(ValueError):
            tilings.HopperTiles(**{"warpgroups": 2, "block_n": 64, "overlap": True,
                                   "producer": True, **bad})
    with pytest.raises(ValueError):
        tilings.HopperTiles(2, 64, True, own_dq=True)
    with pytest.raises(ValueError, match="producer"):
        make_attn_forward_wgmma(Variant("forward", "hopper", 64, "bfloat16", False,
                                        tilings.HopperTiles(2, 64, True, producer=True)))
    w = tilings.HopperTiles(2, 128, True, pingpong=True, stages=3, producer=True)
    assert (w.tag, w.threads, w.block_m, w.launch_bounds) == ("g2n128op3w", 384, 128, (384, 1))
    # the registers setmaxnreg hands over fit what the block holds at entry (168 x 384)
    assert 128 * 24 + 256 * 240 <= 384 * (65536 // 384 // 8 * 8)
    S = 3
    for tt in range(12):
        assert pl.stage_of.py_func(tt, S) == tt % S
        # tile tt is the (tt // S)-th use of its stage: phases 0, 1, 0, ... of "full"
        assert pl.full_parity.py_func(tt, S) == (tt // S) % 2
        if tt >= S:  # the stage's previous tile released it in the phase before
            assert pl.empty_parity.py_func(tt, S) == pl.full_parity.py_func(tt - S, S)
    for d in tilings.HOPPER_HEAD_DIMS:
        for t in tilings.hopper_candidates(d):
            assert tilings.hopper_smem_bytes(t, d) <= tilings.SMEM_LIMIT[(9, 0)], t
    assert [t.tag for t in tilings.HOPPER_CANDIDATES if t not in
            tilings.hopper_candidates(128)] == ["g2n64op3", "g2n64op3w", "g2n192op3",
                                                "g2n192op3w", "g2n64op2", "g2n64op3t",
                                                "g2n192op3wt", "g1n128ob3"]
    assert [t.tag for t in tilings.HOPPER_CANDIDATES if t not in
            tilings.hopper_candidates(64)] == ["g2n128op3x2", "g2n64op2"]
    # D=256: 64-key tiles, the overlapped schedule and the 2-stage ping-pong
    assert [t.tag for t in tilings.hopper_candidates(256)] == ["g2n64o", "g2n64op2"]


class _MBarrier:
    """An mbarrier as the model of :func:`test_pingpong_protocol` sees it: ``count``
    arrivals complete a phase; a parity wait passes once the phase of that parity has
    completed (so a waiter two phases behind would wait forever: a hang, as on the GPU)."""

    def __init__(self, count):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self):
        self.pending -= 1
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def passes(self, parity):
        return (self.phases & 1) != parity


def _pingpong_run(n, producer, rnd, S=3):
    """One random interleaving of the ping-pong schedule's barrier protocol over ``n`` key
    tiles, step by step as ``hopper/pingpong.py`` (warpgroup units: a "full" barrier
    completes on one copier's landing, an "empty" one on both consumers' releases, a named
    barrier on one sync and one arrive). Fails on a hang, on a tile read before it landed,
    on a stage refilled while a consumer still needs its tile, on an unmatched arrival."""
    from flashcore.backends.numba_cuda.device import pipeline as pl

    stage, fpar, epar = (f.py_func for f in (pl.stage_of, pl.full_parity, pl.empty_parity))
    full = {r: [_MBarrier(1) for _ in range(S)] for r in "KV"}
    empty = {r: [_MBarrier(2) for _ in range(S)] for r in "KV"}
    q_full = _MBarrier(1)
    named, ready = {1: [], 2: []}, {1: 0, 2: 0}
    held = {r: [None] * S for r in "KV"}
    landing = []
    unread = {(r, t): {0, 1} for r in "KV" for t in range(n)}

    def produce(ring, t):
        if t < n:
            if t >= S:
                yield ("wait", empty[ring][stage(t, S)], epar(t, S))
            assert not unread.get((ring, t - S)), f"{ring}{t - S} overwritten"
            held[ring][stage(t, S)] = None
            landing.append((ring, t))

    def use(wg, ring, t):
        yield ("wait", full[ring][stage(t, S)], fpar(t, S))
        assert held[ring][stage(t, S)] == t, (ring, t)

    def consumer(wg):
        ring = "KV"[wg]
        if producer:
            yield ("wait", q_full, 0)
        else:
            for t in range(S - 1):
                yield from produce(ring, t)
        if n == 0:
            return
        if wg == 1:
            yield ("arrive", 1, wg)
        for it in range(n + 1):
            if it < n:
                yield from use(wg, "K", it)
            if it > 0:
                yield from use(wg, "V", it - 1)
            yield ("sync", 1 + wg)
            if it < n:
                unread["K", it].discard(wg)
            if it > 0:
                unread["V", it - 1].discard(wg)
            if it < n or wg == 0:
                yield ("arrive", 2 - wg, wg)
            if it < n:
                empty["K"][stage(it, S)].arrive()
            if 0 < it < n:
                empty["V"][stage(it - 1, S)].arrive()
            if it < n and not producer:
                yield from produce(ring, it + S - 1)

    def copier():
        q_full.arrive()
        for t in range(n):
            yield from produce("K", t)
            yield from produce("V", t)

    actors = {0: consumer(0), 1: consumer(1)}
    if producer:
        actors["p"] = copier()
    waiting = dict.fromkeys(actors)
    while actors:
        if landing and rnd.random() < 0.3:
            ring, t = landing.pop(rnd.randrange(len(landing)))
            held[ring][stage(t, S)] = t
            full[ring][stage(t, S)].arrive()
        able = [a for a, w in waiting.items() if w is None
                or (w[0] == "wait" and w[1].passes(w[2])) or (w[0] == "sync" and ready[w[1]])]
        if not able:
            assert landing, f"hang: {n=} {producer=} {waiting}"
            continue
        a = rnd.choice(able)
        if waiting[a] is not None and waiting[a][0] == "sync":
            ready[waiting[a][1]] -= 1
        waiting[a] = None
        op = next(actors[a], None)
        if op is None:
            del actors[a], waiting[a]
        elif op[0] in ("arrive", "sync"):
            who = op[2] if op[0] == "arrive" else "sync"
            assert who not in named[op[1]], f"two arrivals of {who} on barrier {op[1]}"
            named[op[1]].append(who)
            if len(named[op[1]]) == 2:
                named[op[1]], ready[op[1]] = [], ready[op[1]] + 1
            waiting[a] = op if op[0] == "sync" else None
        else:
            waiting[a] = op
    assert not any(unread.values()), "a tile never read"
    assert not any(named.values()), f"unmatched named-barrier arrivals: {named}"


@pytest.mark.parametrize("producer", [False, True])
def test_pingpong_protocol(producer):
    """The ping-pong schedule's turns and rings, as a model run in many random orders: no
    hang, every tile read after it landed and before its stage is refilled, every named
    barrier arrival matched (0 to 11 key tiles, 3 stages)."""
    import random

    rnd = random.Random(17)
    for n in range(12):
        for _ in range(100):
            _pingpong_run(n, producer, rnd)


def _case(dtype="float16", D=64, **options):
    from flashcore._checks import make_case

    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, 2, 40, D)).astype(dtype) for _ in range(3))
    full = {"window": None, "softcap": None, "alibi_slopes": None, "score_mod": None,
            "mask_mod": None, "mod_args": (), "block_mask": None}
    return make_case(q, k, v, causal=True, scale=None, layout="bhnd", explicit=True,
                     options={**full, **options} if options else None)


def test_the_launch_picks_it_only_where_it_should(monkeypatch):
    monkeypatch.setattr(launch, "device_cc", lambda device: (9, 0))
    case = _case()
    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    assert launch.hopper_serves(case, 0)  # by default
    monkeypatch.setenv(launch.HOPPER_ENV, "0")
    assert not launch.hopper_serves(case, 0)
    monkeypatch.setenv(launch.HOPPER_ENV, "1")
    assert launch.hopper_serves(case, 0)
    assert not launch.hopper_serves(_case(D=32), 0)
    # masks and score modifiers: the wgmma forward too (a mask_mod alone: MASK_MOD_TILES'
    # overlapped tiling; with other mods, without the overlap)
    assert launch.hopper_serves(_case(window=(8, 0)), 0)
    assert launch.hopper_serves(_case(softcap=20.0), 0)
    plain = launch.hopper_variant(64, "float16", True)
    assert plain.tiles.overlap
    mm = launch.hopper_variant(64, "float16", True, user=pytypes.SimpleNamespace(
        score_mod=None, mask_mod=lambda b, h, i, j: True))
    assert mm.tiles == tilings.MASK_MOD_TILES[(64, False)] and mm.tiles.overlap
    mm = launch.hopper_variant(64, "float16", True, window=(9, 0),
                               user=pytypes.SimpleNamespace(score_mod=None,
                                                            mask_mod=lambda b, h, i, j: True))
    assert mm.tiles == tilings.HOPPER_MASK_MOD
    # a mask_mod alone at D=128 (causal or not, a window beside it, varlen rows): the
    # persistent kernel (MASK_MOD_PERSISTENT); not without the bulk copies, nor with a
    # score modifier beside it
    alone = pytypes.SimpleNamespace(score_mod=None, mask_mod=lambda b, h, i, j: True)
    both = pytypes.SimpleNamespace(score_mod=lambda s, b, h, i, j: s,
                                   mask_mod=lambda b, h, i, j: True)
    for c, kw in ((True, {}), (False, {}), (True, dict(window=(9, 0))),
                  (False, dict(packed="varlen"))):
        v = launch.hopper_variant(128, "bfloat16", c, user=alone, **kw)
        assert v.tiles == tilings.MASK_MOD_PERSISTENT[128], (c, kw, v.tag)
    for kw in (dict(user=alone, tma_ok=False), dict(user=alone, softcap=20.0),
               dict(user=alone, alibi=True), dict(user=both)):
        assert not launch.hopper_variant(128, "bfloat16", True, **kw).tiles.persistent, kw
    # varlen rows: the forward and the backward; a KV cache: neither
    assert launch.hopper_variant(64, "float16", True, packed="varlen").packed == "varlen"
    assert launch.hopper_variant(64, "float16", True, "dq", packed="varlen").packed == "varlen"
    assert launch.hopper_variant(64, "float16", True, packed="paged") is None
    for cc in ((8, 0), (9, 1), (10, 0), (12, 0)):
        monkeypatch.setattr(launch, "device_cc", lambda device, cc=cc: cc)
        assert not launch.hopper_serves(case, 0), cc


# --- PTX for sm_90a, without a GPU --------------------------------------------------------

@pytest.fixture
def sm90(monkeypatch):
    """Device helpers are typed against the current GPU's compute capability; without one,
    answer 9.0 (the kernels are compiled for cc=(9, 0, "a"))."""
    import numba.cuda.dispatcher as nd

    monkeypatch.setattr(nd, "get_current_device",
                        lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))


@pytest.mark.parametrize("tiles,head_dim,dtype,causal", [
    pytest.param(tt, d, t, c, id=f"{tt.tag}-D{d}-{t}-{'causal' if c else 'full'}",
                 marks=() if _in_ci(tt, (d, t, c)) else pytest.mark.slow)
    for tt in TILINGS for d, t, c in ALL if tt in tilings.hopper_candidates(d)])
def test_ptx_sm90a(sm90, tiles, head_dim, dtype, causal):
    from test_numba_cuda_wgmma import _ptxas

    v = _variant(head_dim, dtype, causal, tiles)
    sig = launch.signature(v.entry, dtype)
    ptx = compile_sm90a(v, sig)
    assert ".target sm_90a" in ptx
    # k-steps of Q Kᵀ and of P V, written out (the overlapped schedule: twice, its first
    # tile's S and its last tile's P V outside the loop)
    copies = 2 if tiles.overlap else 1
    n_ss, n_rs = copies * head_dim // 16, copies * tiles.block_n // 16
    mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
    assert len(mma) == n_ss + n_rs, f"{len(mma)} wgmma (loops left rolled?)"
    kind = "bf16" if dtype == "bfloat16" else "f16"
    ss = [ln for ln in mma if ln.count("{") == 2]  # (RS: one brace more, A's registers)
    rs = [ln for ln in mma if ln.count("{") == 3]
    assert len(ss) == n_ss and len(rs) == n_rs
    if tiles.overlap:  # S of the next tile waited for while P V runs
        assert "wgmma.wait_group.sync.aligned 1;" in ptx
    if tiles.min_blocks > 1:  # compiled for several blocks per SM, and they fit
        assert re.search(rf"\.minnctapersm\s+{tiles.min_blocks}\b", ptx)
        assert tilings.blocks_fit(v.smem_words, tiles.min_blocks, (9, 0))
    assert all(f"m64n{v.tiles.block_n}k16.f32.{kind}.{kind}" in ln for ln in ss)
    assert all(f"m64n{head_dim}k16.f32.{kind}.{kind}" in ln for ln in rs)
    # (the persistent producer form moves Q by a bulk copy too: no generic-proxy writes for
    # the wgmmas to see, no cp.async arrivals)
    q_bulk = tiles.persistent and tiles.producer
    assert ("fence.proxy.async.shared::cta;" in ptx) != q_bulk
    # (a dynamic persistent block takes its next query tile from the launch's counter)
    assert ("atom.add.u32" in ptx) == tiles.dynamic
    if tiles.pingpong:  # turns on named barriers 1 and 2, rings on mbarriers
        for op in ("bar.sync 1, 256;", "bar.sync 2, 256;", "bar.arrive 1, 256;",
                   "bar.arrive 2, 256;", "mbarrier.try_wait.parity.shared::cta.b64",
                   "mbarrier.arrive.shared::cta.b64"):
            assert op in ptx, op
        # the rings' copies: bulk tensor copies of 64 columns each (a K or V tile per
        # warpgroup: AHEAD ones in the prologue, one in the first step, one in the loop;
        # a producer's loop: a K and a V tile), completing their bytes on "full"; or
        # cp.async copies arriving there (a producer's Q arrives so in either case)
        bulk = ("cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx"
                "::bytes")
        if tiles.tma:
            n = ptx.count(bulk)  # (the producer's loop: as LLVM peels it, K and V tiles)
            if q_bulk:  # (K0, Q, V0, then K and V: whole tiles as LLVM peels them)
                assert n % (head_dim // 64) == 0 < n, n
            else:
                assert (n % (2 * head_dim // 64) == 0 < n if tiles.producer
                        else n == (tiles.stages + 1) * head_dim // 64), n
            assert "mbarrier.arrive.expect_tx.shared::cta.b64" in ptx
            assert "fence.proxy.tensormap::generic.acquire.gpu" in ptx
            assert (("cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx)
                    == (tiles.producer and not q_bulk))
        else:
            assert bulk not in ptx
            assert "cp.async.mbarrier.arrive.noinc.shared::cta.b64" in ptx
        # (a persistent producer form's: "q empty" too, and a pair per Q buffer: two with
        # two-stage rings)
        q_bars = tiles.producer * (1 + tiles.persistent) * (1 + q_bulk * (tiles.stages == 2))
        assert len(re.findall(r"mbarrier\.init", ptx)) == 4 * tiles.stages + q_bars
    if tiles.producer:  # registers handed over, under the cap setmaxnreg needs at entry
        # (the dynamic persistent one's producer: 40, for its tile counter's loop)
        give, take = (40, 232) if tiles.dynamic else (24, 240)
        assert f"setmaxnreg.dec.sync.aligned.u32 {give};" in ptx
        assert f"setmaxnreg.inc.sync.aligned.u32 {take};" in ptx
        assert re.search(r"\.maxntid\s+384\b", ptx) and re.search(r"\.minnctapersm\s+1\b", ptx)
    assert ".local" not in ptx, "register tiles went to local memory"
    from ptx_addresses import narrowed_addresses

    assert narrowed_addresses(ptx) == []  # 64-bit addresses: tensors past 2^31 elements
    entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
    assert len(re.findall(r"\.param\s+\.\w+", entry.group(1))) == len(sig)
    res = _ptxas(ptx, "sm_90a")
    if res is None:
        return
    rc, report = res
    assert rc == 0, f"ptxas failed:\n{report[-3000:]}"
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    assert "C7519" not in report, "ptxas serialized wgmmas (registers touched between them)"
    assert "C7512" not in report, "ptxas serialized wgmmas (too few registers)"
    assert "C7508" not in report, "ptxas ignored setmaxnreg"


def _mod_variants():
    """Variants with masks and score modifiers (at D=128 the softcap's and ALiBi's tiling is
    ping-pong, a window's alone the persistent one (WINDOW_PERSISTENT), a score_mod's the
    overlapped schedule, a mask_mod's one without the overlap; at D=256 the overlapped
    64-key tiles), one per kind, each on another head dim, dtype and causal mode; varlen
    rows (packed sequences) too, at D=64 on the table's 192-key bulk copies."""
    from flashcore.backends.numba_cuda.variant import UserMods
    from test_numba_cuda_mods import _takes_all, prefix_lm, rel_bias, same_doc

    user = UserMods(_takes_all(rel_bias, 0, 2), _takes_all(prefix_lm, 1, 2),
                    (("float32", 2), ("int64", 1)))
    smod = UserMods(_takes_all(rel_bias, 0, 2), None, (("float32", 2), ("int64", 1)))
    mmod = UserMods(None, same_doc, (("int32", 2),))
    return [("window", dict(window=(200, 100)), 128, "bfloat16", True),
            ("softcap", dict(softcap=30.0), 128, "bfloat16", False),
            ("alibi", dict(alibi=True), 128, "bfloat16", False),
            ("varlen", dict(packed="varlen"), 128, "bfloat16", True),
            ("varlen64+window", dict(packed="varlen", window=(100, 0)), 64, "float16", True),
            ("softcap64", dict(softcap=20.0), 64, "float16", False),
            ("score_mod", dict(user=smod), 128, "float16", True),
            ("alibi+cap", dict(alibi=True, softcap=30.0), 64, "bfloat16", True),
            ("user", dict(user=user), 64, "bfloat16", False),
            ("user+window", dict(user=user, window=(64, 0)), 128, "float16", True),
            ("window256+cap", dict(window=(200, 100), softcap=30.0), 256, "bfloat16", True),
            ("varlen256+user", dict(packed="varlen", user=user), 256, "float16", False),
            ("varlen64", dict(packed="varlen"), 64, "bfloat16", False),
            ("score_mod64", dict(user=smod, alibi=True), 64, "bfloat16", True),
            ("mask_mod", dict(user=mmod), 128, "bfloat16", False),
            ("mask_mod64", dict(user=mmod), 64, "float16", True)]


@pytest.mark.parametrize("which", [
    pytest.param(i, id=name, marks=() if i < 4 or name == "window256+cap" else pytest.mark.slow)
    for i, name in enumerate(["window", "softcap", "alibi", "varlen", "varlen64+window",
                              "softcap64", "score_mod", "alibi+cap", "user", "user+window",
                              "window256+cap", "varlen256+user", "varlen64",
                              "score_mod64", "mask_mod", "mask_mod64"])])
def test_ptx_sm90a_with_mods(sm90, which):
    """The wgmma forward with masks and score modifiers compiles for sm_90a with the
    launch's parameters, no local memory and (ptxas) no spills nor serialized wgmmas; a
    mask_mod alone takes tilings.MASK_MOD_PERSISTENT's persistent kernel at D=128 and
    MASK_MOD_TILES' overlapped tiling at D=64, with other mods the schedule without the
    overlap."""
    from test_numba_cuda_wgmma import _ptxas

    name, opts, d, dtype, causal = _mod_variants()[which]
    v = launch.hopper_variant(d, dtype, causal, **opts)
    user = opts.get("user")
    mm = user is not None and user.mask_mod is not None
    alone_mm = mm and set(opts) == {"user"} and user.score_mod is None
    if mm:  # (a mask_mod alone: the persistent kernel where it has a tiling)
        assert v.tiles == (tilings.MASK_MOD_PERSISTENT[d]
                           if alone_mm and d in tilings.MASK_MOD_PERSISTENT
                           else tilings.MASK_MOD_TILES.get((d, not alone_mm),
                                                           tilings.HOPPER_MASK_MOD)), v.tag
    # ping-pong: D=128's table (D=64's is g1n128ob3), but a window with other mods
    # (WINDOW_TILES) or user mods (the overlap); a window alone, WINDOW_PERSISTENT's, and
    # varlen rows alone VARLEN_PERSISTENT's where it has one
    alone = set(opts) == {"window"}
    varlen = set(opts) == {"packed"} and (d, causal) in tilings.VARLEN_PERSISTENT
    assert v.tiles.pingpong == (d == 128 and (user is None or alone_mm)
                                and ("window" not in opts or alone)), v.tag
    assert v.tiles.persistent == (d == 128 and (alone or varlen or alone_mm)), v.tag
    assert v.packed == opts.get("packed", "")
    sig = launch.signature(v.entry, dtype, user.args if user is not None else ())
    ptx = compile_sm90a(v, sig)
    assert "wgmma.mma_async" in ptx
    assert ".local" not in ptx, "register tiles went to local memory"
    entry = re.search(r"\.entry\s+\S+\(([^)]*)\)", ptx, re.DOTALL)
    assert len(re.findall(r"\.param\s+\.\w+", entry.group(1))) == len(sig)
    res = _ptxas(ptx, "sm_90a")
    if res is None:
        return
    rc, report = res
    assert rc == 0, f"ptxas failed:\n{report[-3000:]}"
    spilled = sum(map(int, re.findall(r"(\d+) bytes spill stores", report)))
    # Two user mods reading two arrays, a window and head dim 128 (255 registers): a few
    # registers go to the stack (64 bytes at ptxas 13.0; the mma.sync forward of the same
    # variant spills 948 bytes); the relative-bias score_mod alone at head dim 128, in the
    # overlapped schedule, 304 (in ping-pong 392); both user mods at head dim 256 (O alone
    # is 128 registers), 264 (252 before the epilogue through shared memory, 943c649; 256
    # before the class span's scan from each end, seams.class_span);
    # a document mask_mod alone at head dim 128 on the persistent kernel
    # (MASK_MOD_PERSISTENT), 108 (120 bytes of loads; most in the producer's thread,
    # outside the consumers' loop); every other variant none.
    assert spilled <= {"user+window": 64, "score_mod": 304, "varlen256+user": 264,
                       "mask_mod": 108}.get(name, 0), (v.tag, report)
    assert "C7519" not in report, "ptxas serialized wgmmas (registers touched between them)"


@pytest.mark.parametrize("dynamic", [True, False], ids=["counter", "static"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ptx_sm90a_persistent_varlen(sm90, causal, dynamic):
    """The persistent forward on varlen rows (the tile counter, tilings.
    VARLEN_PERSISTENT_TRIAL, or the static walk: the producer's scan of the sequences, the
    tile's words for the consumers, the value rows past a sequence zeroed) compiles for
    sm_90a with the launch's parameters, no local memory, and (ptxas) no spills nor
    serialized wgmmas; the persistent tilings refuse masks other than a window."""
    from dataclasses import replace

    from test_numba_cuda_wgmma import _ptxas

    t = replace(tilings.VARLEN_PERSISTENT_TRIAL, dynamic=dynamic)
    v = Variant("forward", "hopper", 128, "bfloat16", causal, t, packed="varlen")
    ptx = compile_sm90a(v, launch.signature(v.entry, "bfloat16"))
    assert ("atom.add.u32" in ptx) == dynamic and ".local" not in ptx
    res = _ptxas(ptx, "sm_90a")
    if res is not None:
        rc, report = res
        assert rc == 0, f"ptxas failed:\n{report[-3000:]}"
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report
        assert "C7519" not in report and "C7512" not in report
    bad = Variant("forward", "hopper", 128, "bfloat16", causal, t, softcap=30.0)
    with pytest.raises(ValueError):
        compile_sm90a(bad, launch.signature(bad.entry, "bfloat16"))
    # (masked_tiles gives a persistent tiling with the softcap or ALiBi the table's form)
    for kw in ({"softcap": True}, {"alibi": True}):
        assert not tilings.masked_tiles(t, head_dim=128, **kw).persistent


# --- on an H100/H200 ----------------------------------------------------------------------

def _gpu():
    return hopper_gpu_or_skip("the wgmma forward")


@pytest.fixture(scope="module")
def hopper_gpu():
    """torch, once the variants the tests run (and the mma.sync forwards they compare with)
    are compiled in parallel processes (numba's disk cache): one at a time here they would
    take 15-20 s each."""
    torch = _gpu()
    ours = {_variant(d, t, c, tt) for tt, _, d, t, c in GPU_CASES}
    mma = {launch.tc_variants(d, t, c, (9, 0), gpu=launch._gpu(0)[1])[0] for d, t, c in ALL}
    compile_once(ours | mma, "flashcore-hopper-test")
    return torch


#: The table's tilings (and PERSISTENT's) on every shape, dtype, head dim and causal mode;
#: the other candidates in bf16 on the first three shapes (the ping-pong ones on the fourth
#: too: 1024 keys go round their rings more than once).
GPU_CASES = [(tt, shape, d, t, c) for tt in TILINGS for shape in SHAPES for d, t, c in ALL
             if tt in (tilings.choose_hopper(d, c), tilings.choose_hopper(d, c, dense=True))
             or (t == "bfloat16" and tt in tilings.hopper_candidates(d)
                 and (shape in SHAPES[:3] or (tt.pingpong and shape == SHAPES[3])))]


@pytest.mark.gpu
@pytest.mark.parametrize("tiles,shape,head_dim,dtype,causal", [
    pytest.param(*x, id=f"{x[0].tag}-{'x'.join(map(str, x[1]))}-D{x[2]}-{x[3]}-"
                        f"{'causal' if x[4] else 'full'}") for x in GPU_CASES])
def test_hopper_forward_on_gpu(hopper_gpu, monkeypatch, tiles, shape, head_dim, dtype,
                               causal):
    torch = hopper_gpu
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (small calls: the table's copies)
    from helpers import TOL_FWD, oracle_forward, rel_err

    import flashcore

    B, Hq, Hkv, Nq, Nk, layout = shape
    monkeypatch.setenv(launch.HOPPER_ENV, "1")
    monkeypatch.setitem(tilings.HOPPER_FORWARD, (head_dim, causal), tiles)
    no_persistent(monkeypatch)  # (the dense calls: this tiling too)
    monkeypatch.setattr(launch, "_PLANS", {})  # (plans do not key on the wgmma tiling)
    ran = spy_launches(monkeypatch, ("launch_forward",))
    q, k, v, _ = gpu_inputs(torch, shape, head_dim, dtype, Nq * 7 + Nk + head_dim)
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                         backend="numba_cuda")
    assert ran == ["attn_forward_wgmma"], ran
    torch.cuda.synchronize()
    ref_o, ref_lse = oracle_forward(*(x.float().cpu().numpy() for x in (q, k, v)),
                                    causal=causal, layout=layout)
    e = rel_err(o.float().cpu().numpy(), ref_o)
    assert e < TOL_FWD[dtype], f"o: {e}"
    assert rel_err(lse.cpu().numpy(), ref_lse) < 1e-5

    # and with the switch off, the mma.sync kernel (plans keyed by it, chosen per call)
    monkeypatch.setenv(launch.HOPPER_ENV, "0")
    o2, _ = flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                        backend="numba_cuda")
    assert ran[-1] == "attn_forward_tc", ran
    assert rel_err(o2.float().cpu().numpy(), ref_o) < TOL_FWD[dtype]


def _ring_of_three(torch, monkeypatch, n, seed):
    """The tensor maps' ring cut to 3 slots on every call's bulk copies (fresh ring and
    plans), and ``n`` sets of bf16 D=128 arrays with each one's output computed alone:
    ``(sets, alone)``."""
    from flashcore.backends.numba_cuda import tensor_maps

    import flashcore

    monkeypatch.setattr(tensor_maps, "SLOTS", 3)
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)
    monkeypatch.setattr(tensor_maps, "_rings", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    sets = [gpu_inputs(torch, (2, 4, 2, 1024, 1024, "bhnd"), 128, "bfloat16", seed + j)[:3]
            for j in range(n)]
    alone = []
    for q, k, v in sets:
        alone.append(flashcore.attention(q, k, v, backend="numba_cuda"))
        torch.cuda.synchronize()
    return sets, alone


@pytest.mark.gpu
def test_tensor_map_ring_wraps_across_streams_on_gpu(hopper_gpu, monkeypatch):
    """The bulk tensor copies' maps (tensor_maps.py) through a ring of 3 slots: 24 calls on
    two streams, six sets of arrays in turn, queued behind a long GPU sleep on each
    stream, so the ring wraps while the launches that read its slots still wait; each
    output is bit for bit its arrays' alone (no launch read another's maps, no map was
    rewritten under a waiting launch)."""
    torch = hopper_gpu
    import flashcore

    t = tilings.HOPPER_FORWARD[(128, False)]
    assert t.tma and t.producer
    sets, alone = _ring_of_three(torch, monkeypatch, 6, 11)  # (a slot's uses alternate streams)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    outs = []
    for s in streams:
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # (tens of milliseconds: the calls queue up)
    for n in range(24):
        with torch.cuda.stream(streams[n % 2]):
            outs.append(flashcore.attention(*sets[n % 6], backend="numba_cuda"))
    torch.cuda.synchronize()
    for n, o in enumerate(outs):
        assert torch.equal(o, alone[n % 6]), n


@pytest.mark.gpu
def test_tensor_map_ring_reuses_slots_on_gpu(hopper_gpu, monkeypatch):
    """The ring's reuse of a slot that holds a call's maps (tensor_maps._Ring): the same
    arrays again and again on one stream behind a GPU sleep (no copy: the slot count stays),
    then on a second stream (a slot of its own), then enough other arrays to wrap the ring
    of 3 slots, then the first arrays again; each output bit for bit its arrays' alone."""
    torch = hopper_gpu
    from flashcore.backends.numba_cuda import tensor_maps

    import flashcore

    sets, alone = _ring_of_three(torch, monkeypatch, 4, 31)
    main, side = torch.cuda.Stream(), torch.cuda.Stream()
    order = [(0, main)] * 4 + [(0, side), (1, main), (2, main), (3, main), (0, main),
                               (0, side), (0, main)]
    for s in (main, side):
        with torch.cuda.stream(s):
            torch.cuda._sleep(50_000_000)  # (the calls queue up behind it)
    ring = tensor_maps._rings[torch.cuda.current_device()]
    start, outs = ring.next, []
    for n, (j, s) in enumerate(order):
        with torch.cuda.stream(s):
            outs.append((j, flashcore.attention(*sets[j], backend="numba_cuda")))
        if n == 3:  # four calls on the same arrays and stream: one slot written
            assert ring.next == (start + 1) % 3, (start, ring.next)
    torch.cuda.synchronize()
    for j, o in outs:
        assert torch.equal(o, alone[j]), j


@pytest.mark.gpu
@pytest.mark.parametrize("d,causal", list(tilings.LONG_KEYS) if ALL else [])
def test_long_keys_take_their_tiling_on_gpu(hopper_gpu, monkeypatch, d, causal):
    """A forward of tilings.LONG_KEYS_MIN keys or more takes tilings.LONG_KEYS' tiling
    (GQA, a key count past a whole tile, few query rows aligned bottom-right), against the
    float64 oracle; one key fewer, the table's (PERSISTENT's where it has one)."""
    torch = hopper_gpu
    from helpers import TOL_FWD, oracle_forward, rel_err

    import flashcore

    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (a small call: the copies anyway)
    monkeypatch.setattr(launch, "_PLANS", {})
    tags = spy_launches(monkeypatch, ("launch_forward",),
                        name=lambda kern: kern._dispatcher.py_func.__qualname__)
    n = tilings.LONG_KEYS_MIN + 77
    q, k, v, _ = gpu_inputs(torch, (1, 4, 2, 300, n, "bhnd"), d, "bfloat16", 3)
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, backend="numba_cuda")
    assert f"_{tilings.LONG_KEYS[d, causal].tag}_" in tags[-1], tags
    ref_o, ref_lse = oracle_forward(*(x.float().cpu().numpy() for x in (q, k, v)),
                                    causal=causal)
    assert rel_err(o.float().cpu().numpy(), ref_o) < TOL_FWD["bfloat16"]
    assert rel_err(lse.cpu().numpy(), ref_lse) < 1e-5
    m = tilings.LONG_KEYS_MIN - 1
    flashcore.attention_forward(q, k[:, :, :m], v[:, :, :m], causal=causal,
                                backend="numba_cuda")
    assert f"_{tilings.choose_hopper(d, causal, dense=True).tag}_" in tags[-1], tags


@pytest.mark.gpu
def test_captured_forward_skips_the_tensor_maps_on_gpu(hopper_gpu, monkeypatch):
    """A forward captured into a CUDA graph takes the tilings without bulk tensor copies
    (their ring of map slots is rewritten call by call and waits on events, which a graph
    cannot replay); its replays, after the ring went round twice with eager calls that do
    take them, give the eager result bit for bit."""
    torch = hopper_gpu
    from flashcore.backends.numba_cuda import tensor_maps

    import flashcore

    monkeypatch.setattr(tensor_maps, "SLOTS", 3)
    monkeypatch.setattr(tensor_maps, "_rings", {})
    monkeypatch.setattr(launch, "_PLANS", {})
    tags = spy_launches(monkeypatch, ("launch_forward",),
                        name=lambda kern: kern._dispatcher.py_func.__qualname__)
    q, k, v, _ = gpu_inputs(torch, (1, 4, 2, 1024, 1024, "bhnd"), 128, "bfloat16", 5)
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 1 << 62)  # (eager, without the copies)
    plain = flashcore.attention(q, k, v, backend="numba_cuda")
    # (the tilings of bulk copies: "wt" in their tags, g2n128op2wts here: tilings.PERSISTENT)
    assert "wt" not in tags[-1], tags
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)
    eager = flashcore.attention(q, k, v, backend="numba_cuda")
    assert "wt" in tags[-1], tags
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        flashcore.attention(q, k, v, backend="numba_cuda")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = flashcore.attention(q, k, v, backend="numba_cuda")
    assert "wt" not in tags[-1], tags
    for _ in range(7):  # (the ring goes round twice)
        again = flashcore.attention(q, k, v, backend="numba_cuda")
    assert "wt" in tags[-1], tags
    for _ in range(2):
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, plain), "replay"
    assert torch.equal(again, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("persistent", [*(t for t in tilings.HOPPER_CANDIDATES
                                          if t.persistent), *tilings.HOPPER_TRIALS],
                         ids=lambda t: t.tag)
def test_persistent_forward_walks_many_tiles_on_gpu(hopper_gpu, monkeypatch, head_dim,
                                                    causal, persistent):
    """The persistent forwards (g2n128op2wts: two Q buffers, O staged; g2n128op2wtsy: the
    same taking its tiles from a counter; the three-stage trial g2n128op3wts, one Q
    buffer) on more query tiles than the
    GPU has multiprocessors, so that every block walks several (GQA, a key tail, Nq < Nk
    causal), against the float64 oracle; and the same call on the ping-pong tiling gives
    the same output bit for bit (the same products in the same order; lse to its last
    bits)."""
    torch = hopper_gpu
    from helpers import TOL_FWD, oracle_forward, rel_err

    import flashcore

    shape = (3, 8, 2, 1000, 1100, "bnhd")  # 3 x 8 x 8 = 192 query tiles
    B, Hq, Hkv, Nq, Nk, layout = shape
    monkeypatch.setenv(launch.HOPPER_ENV, "1")
    monkeypatch.setattr(launch, "_PLANS", {})
    no_persistent(monkeypatch)  # (HOPPER_FORWARD's tiling, as set)
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (a small call: the bulk copies)
    ran = spy_launches(monkeypatch, ("launch_forward",))
    q, k, v, _ = gpu_inputs(torch, shape, head_dim, "bfloat16", 5 + head_dim)
    outs = []
    for tiles in (persistent, tilings.HopperTiles(2, 128, True, pingpong=True, stages=3)):
        monkeypatch.setitem(tilings.HOPPER_FORWARD, (head_dim, causal), tiles)
        launch.forget_plans()
        outs.append(flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                                backend="numba_cuda"))
    torch.cuda.synchronize()
    assert ran == ["attn_forward_wgmma"] * 2, ran
    (o, lse), (o2, lse2) = outs
    ref_o, ref_lse = oracle_forward(*(x.float().cpu().numpy() for x in (q, k, v)),
                                    causal=causal, layout=layout)
    assert rel_err(o.float().cpu().numpy(), ref_o) < TOL_FWD["bfloat16"]
    assert rel_err(lse.cpu().numpy(), ref_lse) < 1e-5
    assert torch.equal(o, o2)  # (lse's last bits may differ: m sl2 + log2 l, contracted or not)
    assert (lse - lse2).abs().max().item() < 1e-5
    # again on the same arrays, three launches in a row (the same tensor-map slot, so the
    # same tile counters: the last block of each launch must have set them to zero, or the
    # next one skips tiles)
    monkeypatch.setitem(tilings.HOPPER_FORWARD, (head_dim, causal), persistent)
    launch.forget_plans()
    again = [flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                         backend="numba_cuda") for _ in range(3)]
    torch.cuda.synchronize()
    for o3, lse3 in again:
        assert torch.equal(o3, o) and torch.equal(lse3, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("t", [t for t in tilings.HOPPER_CANDIDATES if t.persistent],
                         ids=lambda t: t.tag)
def test_persistent_forward_window_on_gpu(hopper_gpu, monkeypatch, causal, t):
    """The persistent forwards (static walk and counter) with a sliding window on 192
    query tiles (GQA, bnhd, a key tail): each tile's keys from the window's first tile,
    its edge tiles masked, against the float64 reference."""
    torch = hopper_gpu
    from helpers import TOL_FWD, rel_err

    import flashcore

    shape = (3, 8, 2, 1000, 1100, "bnhd")
    B, Hq, Hkv, Nq, Nk, layout = shape
    window = (300, 200)
    monkeypatch.setenv(launch.HOPPER_ENV, "1")
    monkeypatch.setattr(launch, "_PLANS", {})
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (a small call: the bulk copies)
    no_persistent(monkeypatch)  # (WINDOW_PERSISTENT's would replace t)
    monkeypatch.setitem(tilings.HOPPER_FORWARD, (128, causal), t)
    tags = spy_launches(monkeypatch, ("launch_forward",),
                        name=lambda kern: kern._dispatcher.py_func.__qualname__)
    q, k, v, _ = gpu_inputs(torch, shape, 128, "bfloat16", 17)
    o, lse = flashcore.attention_forward(q, k, v, causal=causal, layout=layout,
                                         window=window, backend="numba_cuda")
    torch.cuda.synchronize()
    assert f"_{t.tag}_" in tags[-1], tags
    ro, rl = flashcore.attention_forward(*(x.double().cpu().numpy() for x in (q, k, v)),
                                         causal=causal, layout=layout, window=window,
                                         backend="reference")
    assert rel_err(o.float().cpu().numpy(), ro) < TOL_FWD["bfloat16"]
    got = lse.cpu().numpy()
    finite = np.isfinite(rl)
    assert np.array_equal(np.isfinite(got), finite)
    assert rel_err(got[finite], rl[finite]) < 1e-5


#: Masks and score modifiers on the wgmma forward (test_numba_cuda_mods' case format): the
#: window, the softcap, ALiBi (alone and with the softcap), two user mods reading two arrays
#: (with a window too), and a document mask_mod whose empty tiles are skipped, with and
#: without a BlockMask; at D=128 without a mask_mod, the ping-pong schedule (the softcap
#: and a score_mod alone there too).
MOD_CASES = [
    dict(B=2, Hq=4, Hkv=2, Nq=600, Nk=600, D=128, dtype="bfloat16", causal=True,
         layout="bnhd", mods="", window=(200, 100)),
    dict(B=1, Hq=4, Hkv=4, Nq=333, Nk=500, D=64, dtype="float16", causal=False,
         layout="bhnd", mods="", softcap=20.0),
    dict(B=1, Hq=4, Hkv=2, Nq=500, Nk=333, D=128, dtype="bfloat16", causal=False,
         layout="bhnd", mods="", alibi=True),
    dict(B=2, Hq=2, Hkv=1, Nq=400, Nk=400, D=64, dtype="bfloat16", causal=True,
         layout="bnhd", mods="", alibi=True, softcap=30.0),
    dict(B=1, Hq=4, Hkv=2, Nq=500, Nk=650, D=64, dtype="bfloat16", causal=False,
         layout="bhnd", mods="rel+prefix"),
    dict(B=1, Hq=4, Hkv=2, Nq=500, Nk=500, D=128, dtype="float16", causal=True,
         layout="bhnd", mods="rel+prefix", window=(64, 0)),
    dict(B=2, Hq=4, Hkv=4, Nq=900, Nk=900, D=128, dtype="bfloat16", causal=False,
         layout="bhnd", mods="doc"),
    dict(B=2, Hq=4, Hkv=4, Nq=900, Nk=900, D=64, dtype="float16", causal=True,
         layout="bnhd", mods="doc", block_mask=True),
    # (a document mask_mod alone at D=128: the persistent forward, MASK_MOD_PERSISTENT,
    # causal with a window beside it too)
    dict(B=2, Hq=4, Hkv=2, Nq=900, Nk=1000, D=128, dtype="float16", causal=True,
         layout="bnhd", mods="doc", window=(300, 100)),
    dict(B=1, Hq=4, Hkv=2, Nq=700, Nk=650, D=128, dtype="bfloat16", causal=True,
         layout="bhnd", mods="", softcap=30.0),
    dict(B=1, Hq=2, Hkv=1, Nq=450, Nk=700, D=128, dtype="float16", causal=False,
         layout="bnhd", mods="rel"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("c", MOD_CASES, ids=lambda c: "-".join(
    f"{k}{v}" for k, v in c.items()).replace(" ", ""))
def test_hopper_forward_with_mods_on_gpu(monkeypatch, c):
    """The wgmma forward (that it ran is checked) with masks and score modifiers against
    the float64 reference, forward and the backward that takes its lse."""
    torch = _gpu()
    from test_numba_cuda_mods import _check, _torch_case

    import flashcore

    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    monkeypatch.setattr(tilings, "TMA_MIN_WORK", 0)  # (small calls: the softcap's copies)
    monkeypatch.setattr(launch, "_PLANS", {})
    ran = []
    real = launch.launch_forward

    def spy(kern, *a, **kw):
        ran.append(kern.name)
        return real(kern, *a, **kw)

    monkeypatch.setattr(launch, "launch_forward", spy)
    (q, k, v, do), _, mods, opts = _torch_case(c, torch)
    o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **opts)
    assert ran == ["attn_forward_wgmma"], ran
    grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
    torch.cuda.synchronize()
    hq, hk, hv, hdo = (x.float().cpu().numpy() for x in (q, k, v, do))
    _check(hq, hk, hv, hdo, c, mods, o.float().cpu().numpy(), lse.cpu().numpy(),
           [g.float().cpu().numpy() for g in grads])


def test_warmup_compiles_every_forward_the_table_picks(monkeypatch):
    """``python -m flashcore warmup`` on an sm_90 GPU: the table's wgmma forward, the one of
    calls without bulk tensor copies (small ones) and the one of long key sequences
    (tilings.LONG_KEYS), so that no size of call compiles on its first use."""
    from flashcore.backends.numba_cuda import driver

    from flashcore import _warmup

    monkeypatch.setattr(driver, "device_cc", lambda device: (9, 0))
    monkeypatch.setattr(launch, "_gpu", lambda device: ((9, 0), "NVIDIA H200"))
    monkeypatch.delenv(launch.HOPPER_ENV, raising=False)
    for (d, c), t in tilings.LONG_KEYS.items():
        tags = {v.tiles.tag for v in _warmup.variants(d, "bfloat16", c)
                if v.family == "hopper" and v.kernel == "forward"}
        small = launch.hopper_variant(d, "bfloat16", c, tma_ok=False).tiles
        dense = launch.hopper_variant(d, "bfloat16", c).tiles  # (PERSISTENT's at D=128)
        assert tags == {dense.tag, small.tag, t.tag}, tags
