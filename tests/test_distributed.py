"""Ring attention on torch.distributed with gloo in 2, 3 and 4 CPU processes, and on JAX
with 4 forced host devices: forward and gradients equal single-process
flashcore.attention on the gathered sequence (GQA, both layouts, causal in balanced and
contiguous order, lengths that do not divide evenly, empty chunks); bad input raises the
same error on every rank. ``nox -s tests-distributed`` runs these alone.

Tolerances: float64 results agree to 1e-11 and float32 to 1e-5 (norm-wise): the blocks
are merged by their lse, which the kernels return in float64 for float64 inputs (the
contract), and the ring accumulates in that dtype, so a float64 ring is float64-accurate.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

pytestmark = [pytest.mark.distributed, pytest.mark.torch]

# bf16: both sides round o and each gradient to bf16 (2^-9 relative per element) and the
# ring rounds a block's dK/dV partial sum once per hop with three or more ranks.
TOL = {torch.float64: 1e-11, torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(rank, world, port):
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)


def _inputs(layout, N, dtype, Hq=4, Hkv=2, B=2, D=16):
    g = torch.Generator().manual_seed(0)
    shape = lambda h: (B, h, N, D) if layout == "bhnd" else (B, N, h, D)  # noqa: E731
    mk = lambda h: torch.randn(shape(h), generator=g, dtype=torch.float64).to(dtype)  # noqa
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def _single_process(causal, layout, N, dtype):
    """o, dq, dk, dv and lse of flashcore.attention on the whole sequence (computed once, in
    the test's process: the ranks compare against it instead of each compiling and running
    it again)."""
    import flashcore

    q, k, v, do = _inputs(layout, N, dtype)
    qr, kr, vr = (x.detach().clone().requires_grad_() for x in (q, k, v))
    o_ref, lse_ref = flashcore.attention(qr, kr, vr, causal=causal, layout=layout,
                                         return_lse=True)
    o_ref.backward(do)
    return o_ref.detach(), qr.grad, kr.grad, vr.grad, lse_ref.detach()


def _agree(rank, world, port, causal, balanced, layout, N, dtype, want):
    _init(rank, world, port)
    try:
        import flashcore.distributed as fcd

        q, k, v, do = _inputs(layout, N, dtype)
        shard = lambda x: fcd.shard_sequence(x, layout=layout, balanced=balanced)  # noqa
        ql, kl, vl = (shard(x).detach().requires_grad_() for x in (q, k, v))
        o, lse = fcd.ring_attention(ql, kl, vl, causal=causal, layout=layout,
                                    balanced=balanced, return_lse=True)
        o.backward(shard(do))
        gather = lambda x: fcd.gather_sequence(x, layout=layout, balanced=balanced)  # noqa
        got = [gather(x) for x in (o.detach(), ql.grad, kl.grad, vl.grad)]
        *ref, lse_ref = want
        for name, a, b in zip(("o", "dq", "dk", "dv"), got, ref):
            err = float((a.double() - b.double()).norm() / b.double().norm())
            assert err < TOL[dtype], (name, err)
        lse_full = fcd.gather_sequence(lse.transpose(1, 2), layout="bnhd",
                                       balanced=balanced).transpose(1, 2)
        fin = torch.isfinite(lse_ref)
        assert torch.equal(torch.isfinite(lse_full), fin)
        assert lse_full.dtype == lse_ref.dtype
        lse_tol = 1e-12 if dtype == torch.float64 else 1e-5
        assert float((lse_full[fin] - lse_ref[fin]).abs().max()) < lse_tol
    finally:
        dist.destroy_process_group()


slow = pytest.mark.slow  # (CI runs one case per world size; nox all)
CASES = [  # world, causal, balanced, layout, N, dtype
    (2, True, True, "bhnd", 64, torch.float64),
    pytest.param(2, False, True, "bnhd", 37, torch.float32, marks=slow),
    (3, True, False, "bnhd", 61, torch.float32),
    pytest.param(3, True, True, "bhnd", 50, torch.float64, marks=slow),
    (4, True, True, "bnhd", 13, torch.float32),  # chunks of 2: the last three are empty
    pytest.param(4, False, False, "bhnd", 30, torch.float32, marks=slow),
    pytest.param(3, True, True, "bhnd", 66, torch.bfloat16, marks=slow),  # dK/dV in bf16
]


def _case_id(c):
    c = c.values if hasattr(c, "values") else c
    return (f"W{c[0]}-{'causal' if c[1] else 'full'}-{'zigzag' if c[2] else 'contiguous'}-"
            f"{c[3]}-N{c[4]}-{str(c[5]).removeprefix('torch.')}")


@pytest.mark.parametrize("world,causal,balanced,layout,N,dtype", CASES,
                         ids=[_case_id(c) for c in CASES])
def test_ring_equals_single_process(world, causal, balanced, layout, N, dtype):
    want = _single_process(causal, layout, N, dtype)
    mp.spawn(_agree, args=(world, _port(), causal, balanced, layout, N, dtype, want),
             nprocs=world)


def _bad(rank, world, port, what):
    _init(rank, world, port)
    try:
        import flashcore.distributed as fcd

        q, k, v, _ = _inputs("bhnd", 12, torch.float32)
        ql, kl, vl = (fcd.shard_sequence(x) for x in (q, k, v))
        want = {"heads": "disagree on q", "length": "hold", "short": "shorter than the world",
                "kv": "same tokens"}[what]
        if what == "heads" and rank == 1:
            ql = ql[:, :2]
        if what == "length" and rank == 1:
            ql, kl, vl = (x[:, :, :-1] for x in (ql, kl, vl))
        if what == "short":
            ql, kl, vl = (x[:, :, :0] if rank else x[:, :, :1] for x in (ql, kl, vl))
        if what == "kv" and rank == 1:
            kl, vl = kl[:, :, :-1], vl[:, :, :-1]
        with pytest.raises(ValueError, match=want):
            fcd.ring_attention(ql, kl, vl, causal=True)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("what", ["heads", "length", pytest.param("short", marks=slow),
                                  pytest.param("kv", marks=slow)])
def test_bad_input_raises_on_every_rank(what):
    """Each rank raises the same ValueError (a rank that did not would hang its peers)."""
    mp.spawn(_bad, args=(2, _port(), what), nprocs=2)


def test_sequence_order_and_chunks():
    import flashcore.distributed as fcd
    from flashcore.distributed import _chunks

    assert fcd.sequence_order(8, 2, balanced=True) == [0, 1, 6, 7, 2, 3, 4, 5]
    assert fcd.sequence_order(8, 2, balanced=False) == list(range(8))
    assert [b - a for a, b in _chunks.chunk_bounds(10, 8)] == [2, 2, 2, 2, 2, 0, 0, 0]
    assert sorted(fcd.sequence_order(13, 4)) == list(range(13))


JAX_SCRIPT = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import jax, jax.numpy as jnp, numpy as np
    jax.config.update("jax_enable_x64", True)
    from jax.sharding import Mesh, PartitionSpec as P
    import flashcore, flashcore.distributed as fcd
    try:
        from jax import shard_map
    except ImportError:
        from jax.experimental.shard_map import shard_map
    W, N = 4, 64
    mesh = Mesh(np.array(jax.devices()[:W]), ("sp",))
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 4, N, 16)))
    k, v = (jnp.asarray(rng.standard_normal((2, 2, N, 16))) for _ in range(2))
    for causal, balanced in ((True, True), (True, False), (False, True)):
        perm = np.asarray(fcd.sequence_order(N, W, balanced=balanced))
        inv = np.argsort(perm)
        spec = P(None, None, "sp", None)
        ring = shard_map(lambda q, k, v: fcd.ring_attention(
            q, k, v, axis_name="sp", causal=causal, balanced=balanced),
            mesh=mesh, in_specs=(spec, spec, spec), out_specs=spec)
        loss = lambda q, k, v: jnp.sum(jnp.sin(ring(q, k, v)))
        qp, kp, vp = (x[:, :, perm] for x in (q, k, v))
        o = jax.jit(ring)(qp, kp, vp)[:, :, inv]
        g = [x[:, :, inv] for x in jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(qp, kp, vp)]
        ref = lambda q, k, v: flashcore.attention(q, k, v, causal=causal)
        o_ref = ref(q, k, v)
        g_ref = jax.grad(lambda q, k, v: jnp.sum(jnp.sin(ref(q, k, v))),
                         argnums=(0, 1, 2))(q, k, v)
        for name, a, b in zip(("o", "dq", "dk", "dv"), (o, *g), (o_ref, *g_ref)):
            err = float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
            assert err < 1e-11, (causal, balanced, name, err)
    print("ok")
""")


@pytest.mark.jax
def test_jax_ring_in_shard_map():
    """In a fresh process (the device count is fixed when JAX starts)."""
    pytest.importorskip("jax")
    proc = subprocess.run([sys.executable, "-c", JAX_SCRIPT], capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        proc.stdout[-3000:] + proc.stderr[-3000:])
