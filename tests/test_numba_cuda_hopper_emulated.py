"""The Hopper (wgmma) kernels end to end in the CUDA simulator, their wgmmas emulated
(tests/wgmma_emulator.py: operands read from the block's shared memory through the
descriptors and the PTX ISA's canonical layouts, register A fragments gathered from the
warpgroup), through the front end, against the float64 oracle.

What this checks that the per-piece tests cannot: how a kernel composes the pieces (which
tile and buffer each product reads at each step, the k-steps, the head loop of GQA, the
lse and delta rows, the stores, tails and masks). The forward, which passed on an H100,
checks the emulation itself. Not checked here: the hardware's asynchrony (fences, waits,
the proxies), which only a GPU shows.

A plain ``pytest`` run has one test that runs this file again in a subprocess with
``NUMBA_ENABLE_CUDASIM=1``; run the cases directly with
``NUMBA_ENABLE_CUDASIM=1 pytest tests/test_numba_cuda_hopper_emulated.py``.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") == "1"
pytestmark = [
    pytest.mark.cudasim,
    pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                       reason="numba-cuda is not installed"),
]

#: (B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout): GQA, tails, Nq < Nk and Nq > Nk causal
#: (rows that see no key), both layouts, both dtypes, both head dims; small, as the
#: simulator runs every thread in Python (a block is 256 of them).
CASES = [
    (1, 2, 1, 70, 150, 64, "bfloat16", True, "bhnd"),
    (1, 2, 2, 150, 77, 64, "float16", True, "bnhd"),
    (1, 1, 1, 130, 100, 128, "float16", False, "bnhd"),
    (1, 2, 1, 40, 140, 128, "bfloat16", True, "bhnd"),
]


def _id(c):
    return "x".join(map(str, c[:6])) + f"-{c[6]}-{'causal' if c[7] else 'full'}-{c[8]}"


if not SIM:

    @pytest.mark.parametrize("only", [
        # (about 45 s: GQA, causal Nq < Nk, bf16; the varlen cases took 3 min more in CI,
        # which the varlen GPU tests and PTX checks cover there)
        pytest.param(f"forward_and_backward and {_id(CASES[0])}", id="ci"),
        pytest.param("", id="all", marks=pytest.mark.slow)])  # (about 7 min)
    def test_hopper_kernels_under_simulator(only):
        """Runs the cases below in a subprocess with the simulator on (CI: the first)."""
        env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1", FLASHCORE_POISON="1")
        here = Path(__file__).resolve()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(here)]
            + (["-k", only] if only else []),
            cwd=here.parent.parent, env=env, capture_output=True, text=True, timeout=3000,
            check=False,
        )
        tail = (proc.stdout + proc.stderr)[-6000:]
        assert proc.returncode == 0, f"simulator run failed:\n{tail}"
        assert " passed" in proc.stdout, tail
        print(proc.stdout.strip().splitlines()[-1])

else:
    from flashcore.backends.numba_cuda import launch, tilings
    from helpers import (
        TOL_BWD,
        TOL_FWD,
        grad_floor,
        oracle_backward,
        oracle_forward,
        rand,
        rel_err,
    )

    import flashcore

    @pytest.fixture
    def emulated(monkeypatch):
        """The wgmma emulation in place, the Hopper kernels chosen (the launch declines them
        under the simulator), and the kernels that ran, by name. The emulation has no
        mbarriers or named barriers: forwards whose table tiling is ping-pong take the
        overlapped schedule of the same block shape here (the ping-pong protocol has its
        own model test in test_numba_cuda_hopper)."""
        import wgmma_emulator

        wgmma_emulator.install(monkeypatch)
        for key, t in list(tilings.HOPPER_FORWARD.items()):
            if t.pingpong:
                monkeypatch.setitem(tilings.HOPPER_FORWARD, key,
                                    tilings.HopperTiles(t.warpgroups, t.block_n, True))
        monkeypatch.setattr(launch, "hopper_serves", lambda case, device: True)
        monkeypatch.setattr(launch, "_PLANS", {})
        ran = []
        for fn in ("launch_forward", "launch_dkdv", "launch_dq"):
            real = getattr(launch, fn)

            def spy(kern, *a, real=real, **kw):
                ran.append(kern.name)
                return real(kern, *a, **kw)

            monkeypatch.setattr(launch, fn, spy)
        return ran

    def _inputs(c):
        B, Hq, Hkv, Nq, Nk, D, dtype, causal, layout = c
        rng = np.random.default_rng(Nq + Nk + D)
        return (rand(rng, (B, Hq, Nq, D), dtype, layout), rand(rng, (B, Hkv, Nk, D), dtype, layout),
                rand(rng, (B, Hkv, Nk, D), dtype, layout), rand(rng, (B, Hq, Nq, D), dtype, layout))

    @pytest.mark.parametrize("c", CASES, ids=_id)
    def test_forward_and_backward(emulated, c):
        q, k, v, do = _inputs(c)
        dtype, causal, layout = c[6], c[7], c[8]
        opts = dict(causal=causal, layout=layout)
        o, lse = flashcore.attention_forward(q, k, v, backend="numba_cuda", **opts)
        assert emulated == ["attn_forward_wgmma"]
        ro, rl = oracle_forward(q, k, v, **opts)
        assert rel_err(o, ro) < TOL_FWD[dtype], rel_err(o, ro)
        assert rel_err(lse, rl) < 1e-5
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
        assert emulated[1:] == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"]
        refs = oracle_backward(do, q, k, v, **opts)
        floors = grad_floor(do, q, k, v, **opts)
        for name, g, r, x, f in zip(("dq", "dk", "dv"), grads, refs, (q, k, v), floors):
            assert g.dtype == x.dtype and g.shape == x.shape
            e = rel_err(g, r, f)
            assert e < TOL_BWD[dtype], f"{name}: {e}"

    @pytest.mark.parametrize("D,dtype,causal", [(64, "bfloat16", True),
                                                 (128, "float16", False)])
    def test_varlen_forward_and_backward(emulated, D, dtype, causal):
        """Packed sequences on the wgmma kernels (each block reads its sequence's offsets;
        lse and delta in FlashAttention 2's (Hq, total_q) rows): an empty sequence, one
        with more queries than keys (rows that see no key, causal), GQA, against the
        per-sequence float64 oracle, forward and backward."""
        from packed_helpers import oracle_varlen, packed

        rng = np.random.default_rng(D)
        q, k, v, cq, ck = packed(rng, [0, 70, 21, 40], [9, 50, 21, 90], Hq=4, Hkv=2, D=D,
                                 dtype=dtype)
        do = rand(rng, q.shape, dtype, "bhnd")
        o, lse = flashcore.attention_varlen_forward(q, k, v, cq, ck, causal=causal,
                                                    backend="numba_cuda")
        assert emulated == ["attn_forward_wgmma"]
        ro, rl, *rg = oracle_varlen(q, k, v, cq, ck, do=do, causal=causal)
        assert rel_err(o, ro) < TOL_FWD[dtype], rel_err(o, ro)
        fin = np.isfinite(rl)
        assert np.array_equal(np.isfinite(lse), fin)
        assert np.abs(lse[fin] - rl[fin]).max() < 1e-4
        grads = flashcore.attention_varlen_backward(do, q, k, v, o, lse, cq, ck, causal=causal,
                                                    backend="numba_cuda")
        assert emulated[1:] == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"]
        for name, g, r in zip(("dq", "dk", "dv"), grads, rg):
            assert rel_err(g, r) < TOL_BWD[dtype], f"{name}: {rel_err(g, r)}"

    @pytest.mark.parametrize("pair", [
        (tilings.HopperTiles(2, 64), tilings.HopperTiles(2, 128)),  # (no overlap)
        (tilings.HopperTiles(2, 64, True), tilings.HopperTiles(2, 128, True))],
                             ids=lambda p: f"{p[0].tag}-{p[1].tag}")
    def test_backward_candidates(emulated, monkeypatch, pair):
        c = (1, 2, 1, 100, 90, 64, "bfloat16", True, "bhnd")
        monkeypatch.setitem(tilings.HOPPER_DKDV, (64, True), pair[0])
        monkeypatch.setitem(tilings.HOPPER_DQ, (64, True), pair[1])
        q, k, v, do = _inputs(c)
        opts = dict(causal=True, layout="bhnd")
        o, lse = oracle_forward(q, k, v, **opts)
        o = o.astype(q.dtype)
        lse = lse.astype(np.float32)
        grads = flashcore.attention_backward(do, q, k, v, o, lse, backend="numba_cuda", **opts)
        assert emulated == ["attn_backward_dkdv_wgmma", "attn_backward_dq_wgmma"]
        refs = oracle_backward(do, q, k, v, **opts)
        floors = grad_floor(do, q, k, v, **opts)
        for name, g, r, f in zip(("dq", "dk", "dv"), grads, refs, floors):
            e = rel_err(g, r, f)
            assert e < TOL_BWD["bfloat16"], f"{name}: {e}"
