"""The warp-level tensor-core primitives of backends/numba_cuda/device/intrinsics.py.

One kernel, run by one warp, moves A (16x16), Bᵀ (8x16) and B (16x8) into shared memory
with cp.async, loads the fragments with ldmatrix (B twice: from Bᵀ rows, and from B rows
with ``.trans``), multiplies with mma m16n8k16 and packs and shuffles the results. Inputs
are small integers, so the fp32 products are exact and must equal NumPy's bit for bit.

- Under the CUDA simulator (run in a subprocess from an ordinary pytest run): the
  plain-Python equivalents, which build each lane's registers from the PTX fragment layouts.
- Without a GPU: compile_ptx for sm_80 and sm_90 shows the instructions in the PTX.
- On a GPU (marked ``gpu``): the intrinsics themselves, against the same NumPy results.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import types as pytypes
from pathlib import Path

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
HAVE_NUMBA_CUDA = importlib.util.find_spec("numba_cuda") is not None
pytestmark = pytest.mark.skipif(not HAVE_NUMBA_CUDA, reason="numba-cuda is not installed")
KINDS = ("bf16", "f16")
if HAVE_NUMBA_CUDA:
    # a module global: the simulator swaps in its own ``cuda`` through kernels' globals
    from numba import cuda, uint16


def _inputs(kind, seed=0):
    """(a 16x16, bt 8x16, b 16x8 as stored: bf16 bits or float16; c 16x8 float32; and the
    float64 product a @ b + c)."""
    rng = np.random.default_rng(seed)
    a = rng.integers(-4, 5, (16, 16)).astype(np.float32)
    b = rng.integers(-4, 5, (16, 8)).astype(np.float32)
    c = rng.integers(-8, 9, (16, 8)).astype(np.float32) * np.float32(0.5)

    def stored(x):
        if kind == "f16":
            return np.ascontiguousarray(x.astype(np.float16))
        return np.ascontiguousarray((x.view(np.uint32) >> 16).astype(np.uint16))

    ref = a.astype(np.float64) @ b.astype(np.float64) + c
    return stored(a), stored(np.ascontiguousarray(b.T)), stored(b), c, ref


def _make_kernel(kind):
    from flashcore.backends.numba_cuda.device.convert import smem_pointer
    from flashcore.backends.numba_cuda.device.intrinsics import (
        cp_async16,
        cp_async_commit,
        cp_async_wait,
        ldmatrix_x4,
        ldmatrix_x4_trans,
        mma_bf16,
        mma_f16,
        pack_bf16x2,
        pack_f16x2,
        shfl_xor_f32,
    )

    mma = mma_bf16 if kind == "bf16" else mma_f16
    pack = pack_bf16x2 if kind == "bf16" else pack_f16x2

    def mma_probe(a, bt, b, c, d1, d2, packed, shuffled):
        sm = smem_pointer(cuda.shared.array(512, uint16))  # A 0..255, Bᵀ 256..383, B 384..
        lane = cuda.laneid
        for ch in range(lane, 64, 32):  # 16-byte chunks: 32 of A, 16 of Bᵀ, 16 of B
            if ch < 32:
                cp_async16(sm, ch * 8, a, ch * 8, 16)
            elif ch < 48:
                cp_async16(sm, 256 + (ch - 32) * 8, bt, (ch - 32) * 8, 16)
            else:
                cp_async16(sm, 384 + (ch - 48) * 8, b, (ch - 48) * 8, 16)
        cp_async_commit()
        cp_async_wait(0)
        cuda.syncthreads()
        a0, a1, a2, a3 = ldmatrix_x4(sm, (lane % 16) * 16 + 8 * (lane // 16))
        # Bᵀ rows are B's columns: matrix 0 = k 0..7, matrix 1 = k 8..15 (2 and 3 repeat)
        r0, r1, _r2, _r3 = ldmatrix_x4(sm, 256 + (lane & 7) * 16 + 8 * ((lane >> 3) & 1))
        # B rows, transposed: matrix 0 = rows k 0..7, matrix 1 = rows 8..15
        s0, s1, _s2, _s3 = ldmatrix_x4_trans(sm, 384 + ((lane & 7) + 8 * ((lane >> 3) & 1)) * 8)
        g = lane >> 2
        t = lane & 3
        c0 = c[g * 8 + 2 * t]
        c1 = c[g * 8 + 2 * t + 1]
        c2 = c[(g + 8) * 8 + 2 * t]
        c3 = c[(g + 8) * 8 + 2 * t + 1]
        e0, e1, e2, e3 = mma(a0, a1, a2, a3, r0, r1, c0, c1, c2, c3)
        f0, f1, f2, f3 = mma(a0, a1, a2, a3, s0, s1, c0, c1, c2, c3)
        d1[g * 8 + 2 * t] = e0
        d1[g * 8 + 2 * t + 1] = e1
        d1[(g + 8) * 8 + 2 * t] = e2
        d1[(g + 8) * 8 + 2 * t + 1] = e3
        d2[g * 8 + 2 * t] = f0
        d2[g * 8 + 2 * t + 1] = f1
        d2[(g + 8) * 8 + 2 * t] = f2
        d2[(g + 8) * 8 + 2 * t + 1] = f3
        packed[2 * lane] = pack(e0, e1)
        packed[2 * lane + 1] = pack(e2, e3)
        shuffled[lane] = shfl_xor_f32(e0, 1)

    mma_probe.__qualname__ = f"mma_probe_{kind}"
    return mma_probe


def _run_and_check(kernel, kind, to_device=None):
    from flashcore.backends.numba_cuda.device.intrinsics import (
        a_coords,
        b_coords,
        c_coords,
        float_to_bits,
    )

    a, bt, b, c, ref = _inputs(kind, seed=len(kind))
    d1 = np.full(128, np.nan, np.float32)
    d2 = np.full(128, np.nan, np.float32)
    packed = np.zeros(64, np.uint32)
    shuffled = np.full(32, np.nan, np.float32)
    args = [a.ravel(), bt.ravel(), b.ravel(), c.ravel(), d1, d2, packed, shuffled]
    if to_device is not None:
        dev = [to_device(x) for x in args]
        kernel[1, 32](*dev)
        d1, d2, packed, shuffled = (x.copy_to_host() for x in dev[4:])
    else:
        kernel[1, 32](*args)
    np.testing.assert_array_equal(d1.reshape(16, 8), ref.astype(np.float32))
    np.testing.assert_array_equal(d2.reshape(16, 8), ref.astype(np.float32))
    ref32 = ref.astype(np.float32)
    for lane in range(32):
        (i0, j0), (i1, j1), (i2, j2), (i3, j3) = c_coords(lane)
        lo = int(packed[2 * lane]) & 0xFFFF, int(packed[2 * lane]) >> 16
        hi = int(packed[2 * lane + 1]) & 0xFFFF, int(packed[2 * lane + 1]) >> 16
        assert lo == (float_to_bits(ref32[i0, j0], kind), float_to_bits(ref32[i1, j1], kind))
        assert hi == (float_to_bits(ref32[i2, j2], kind), float_to_bits(ref32[i3, j3], kind))
        (pi, pj) = c_coords(lane ^ 1)[0]
        assert shuffled[lane] == ref32[pi, pj]
    # the layouts cover each tile exactly once
    assert sorted(x for ln in range(32) for x in a_coords(ln)) == [
        (i, j) for i in range(16) for j in range(16)]
    assert sorted(x for ln in range(32) for x in b_coords(ln)) == [
        (i, j) for i in range(16) for j in range(8)]
    assert sorted(x for ln in range(32) for x in c_coords(ln)) == [
        (i, j) for i in range(16) for j in range(8)]


def _make_stmatrix_kernel():
    """One warp: each lane's four registers (distinct 16-bit halves) stored by stmatrix
    (rows, and transposed, into two regions of 4 x 64 elements), then loaded back by
    ldmatrix from the same addresses (lanes ``8m..8m+7``: the rows of matrix ``m``)."""
    from flashcore.backends.numba_cuda.device.convert import smem_pointer
    from flashcore.backends.numba_cuda.device.intrinsics import ldmatrix_x4, ldmatrix_x4_trans
    from flashcore.backends.numba_cuda.device.stmatrix import stmatrix_x4, stmatrix_x4_trans

    def stmatrix_probe(stored, back):
        sm = smem_pointer(cuda.shared.array(512, uint16))
        lane = cuda.laneid
        r = cuda.local.array(4, np.uint32)
        for m in range(4):
            lo = 1000 * m + 2 * lane + 1
            r[m] = np.uint32(lo | ((lo + 1) << 16))
        at = (lane >> 3) * 64 + (lane & 7) * 8
        stmatrix_x4(sm, at, r[0], r[1], r[2], r[3])
        stmatrix_x4_trans(sm, 256 + at, r[0], r[1], r[2], r[3])
        cuda.syncthreads()
        a0, a1, a2, a3 = ldmatrix_x4(sm, at)
        b0, b1, b2, b3 = ldmatrix_x4_trans(sm, 256 + at)
        back[8 * lane] = a0
        back[8 * lane + 1] = a1
        back[8 * lane + 2] = a2
        back[8 * lane + 3] = a3
        back[8 * lane + 4] = b0
        back[8 * lane + 5] = b1
        back[8 * lane + 6] = b2
        back[8 * lane + 7] = b3
        for i in range(lane, 512, 32):
            stored[i] = sm[i]

    return stmatrix_probe


def _check_stmatrix(kernel, to_device=None):
    """The stored layouts (matrix ``m`` row ``g``, elements ``2t, 2t+1`` from lane ``4g +
    t``'s register ``m``; transposed: elements ``(2t, g)``, ``(2t+1, g)``) and the round
    trip through ldmatrix."""
    stored = np.zeros(512, np.uint16)
    back = np.zeros(256, np.uint32)
    if to_device is not None:
        dev = [to_device(x) for x in (stored, back)]
        kernel[1, 32](*dev)
        stored, back = (x.copy_to_host() for x in dev)
    else:
        kernel[1, 32](stored, back)
    rows = np.zeros((4, 8, 8), np.uint16)
    for lane in range(32):
        g, t = lane >> 2, lane & 3
        for m in range(4):
            lo = 1000 * m + 2 * lane + 1
            rows[m, g, 2 * t:2 * t + 2] = (lo, lo + 1)
    np.testing.assert_array_equal(stored[:256].reshape(4, 8, 8), rows)
    np.testing.assert_array_equal(stored[256:].reshape(4, 8, 8), rows.transpose(0, 2, 1))
    want = np.array([[(1000 * m + 2 * ln + 1) | ((1000 * m + 2 * ln + 2) << 16)
                      for m in range(4)] for ln in range(32)], np.uint32)
    np.testing.assert_array_equal(back.reshape(32, 2, 4)[:, 0], want)
    np.testing.assert_array_equal(back.reshape(32, 2, 4)[:, 1], want)


if SIM:
    pytestmark = [pytestmark, pytest.mark.cudasim]

    @pytest.mark.parametrize("kind", KINDS)
    def test_primitives_under_simulator(kind):
        _run_and_check(cuda.jit(_make_kernel(kind)), kind)

    def test_stmatrix_under_simulator():
        _check_stmatrix(cuda.jit(_make_stmatrix_kernel()))

else:

    @pytest.mark.cudasim
    def test_primitives_in_simulator_subprocess():
        """Runs this file again with the simulator on."""
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
        here = Path(__file__).resolve()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)],
            cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=900,
            check=False,
        )
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"simulator run failed:\n{tail}"
        assert " passed" in proc.stdout, tail

    def ptxas_report(ptx, cc):
        """``ptxas -v`` on ``ptx`` for ``cc``: its report (None without ptxas). A PTX
        ``.version`` newer than ptxas knows is lowered to the one it names."""
        import re
        import shutil
        import tempfile

        exe = shutil.which("ptxas")
        if exe is None:
            return None
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            for _ in range(2):
                src.write_text(ptx)
                proc = subprocess.run([exe, f"-arch=sm_{cc[0]}{cc[1]}", "-v", "-o",
                                       str(Path(d) / "k.cubin"), str(src)],
                                      capture_output=True, text=True, check=False)
                m = re.search(r"current version is '([0-9.]+)'", proc.stderr)
                if proc.returncode == 0 or m is None:
                    break
                ptx = re.sub(r"^\.version \S+", f".version {m.group(1)}", ptx, flags=re.M)
        assert proc.returncode == 0, f"ptxas failed:\n{proc.stderr[-3000:]}"
        return proc.stderr

    def _ptx(kind, cc, monkeypatch):
        import numba.cuda.dispatcher as nd
        from numba.cuda import types

        monkeypatch.setattr(nd, "get_current_device",
                            lambda: pytypes.SimpleNamespace(compute_capability=cc))
        elem = types.uint16 if kind == "bf16" else types.float16
        sig = (types.CPointer(elem),) * 3 + (types.CPointer(types.float32),) * 3 + (
            types.CPointer(types.uint32), types.CPointer(types.float32))
        try:
            ptx, _ = cuda.compile_ptx(_make_kernel(kind), sig, cc=cc)
        except Exception as e:
            if "NVVM" in str(e) or "libnvvm" in str(e).lower():
                pytest.skip(f"the CUDA toolkit (NVVM) is not importable: {e}")
            raise
        return ptx

    @pytest.mark.parametrize("cc", [(8, 0), (9, 0)], ids=["sm80", "sm90"])
    @pytest.mark.parametrize("kind", KINDS)
    def test_primitives_ptx(kind, cc, monkeypatch):
        ptx = _ptx(kind, cc, monkeypatch)
        ptxas_report(ptx, cc)  # the inline PTX assembles (where ptxas is installed)
        assert f".target sm_{cc[0]}{cc[1]}" in ptx
        for instr in (f"mma.sync.aligned.m16n8k16.row.col.f32.{kind}.{kind}.f32",
                      "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
                      "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
                      "cp.async.cg.shared.global", "cp.async.commit_group",
                      "cp.async.wait_group 0", f"cvt.rn.{kind}x2.f32", "shfl.sync.bfly"):
            assert instr in ptx, f"{instr} missing from the PTX"
        assert ptx.count("mma.sync.aligned") == 2
        assert "ld.local" not in ptx and "st.local" not in ptx

    def test_stmatrix_ptx(monkeypatch):
        """stmatrix (sm_90) in the PTX, and the PTX assembles."""
        import numba.cuda.dispatcher as nd
        from numba.cuda import types

        monkeypatch.setattr(nd, "get_current_device",
                            lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))
        sig = (types.CPointer(types.uint16), types.CPointer(types.uint32))
        try:
            ptx, _ = cuda.compile_ptx(_make_stmatrix_kernel(), sig, cc=(9, 0))
        except Exception as e:
            if "NVVM" in str(e) or "libnvvm" in str(e).lower():
                pytest.skip(f"the CUDA toolkit (NVVM) is not importable: {e}")
            raise
        ptxas_report(ptx, (9, 0))
        for instr in ("stmatrix.sync.aligned.m8n8.x4.shared.b16",
                      "stmatrix.sync.aligned.m8n8.x4.trans.shared.b16"):
            assert instr in ptx, f"{instr} missing from the PTX"

    def _gpu_reason():
        from flashcore.backends import numba_cuda

        r = numba_cuda.unavailable_reason()
        if r is None and tuple(cuda.get_current_device().compute_capability) < (8, 0):
            r = "the primitives need sm_80 or newer"
        return r

    @pytest.mark.gpu
    @pytest.mark.parametrize("kind", KINDS)
    def test_primitives_on_gpu(kind):
        reason = _gpu_reason()
        if reason is not None:
            pytest.skip(reason)
        _run_and_check(cuda.jit(_make_kernel(kind)), kind, to_device=cuda.to_device)

    @pytest.mark.gpu
    def test_stmatrix_on_gpu():
        reason = _gpu_reason()
        if reason is None and tuple(cuda.get_current_device().compute_capability) < (9, 0):
            reason = "stmatrix needs sm_90"
        if reason is not None:
            pytest.skip(reason)
        _check_stmatrix(cuda.jit(_make_stmatrix_kernel()), to_device=cuda.to_device)
