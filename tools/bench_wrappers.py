"""What the PyTorch and JAX glue costs on top of the kernels.

For each framework and device, the same call is timed two ways:

- **wrapper**: ``flashcore.attention`` as a user calls it: torch tensors that require grad
  (the ``flashcore::attention_forward`` custom op and its autograd node), or a jitted
  function of JAX arrays (the ``custom_vjp`` around the kernels' callbacks); forward, and
  forward + backward;
- **direct**: the backend module that the dispatcher picks for the same case, called with a
  prebuilt :class:`~flashcore._case.Case` (``backend.forward(q, k, v, case)`` and
  ``backend.backward(...)``): the kernels and their own buffer handling, nothing else.

At N=4096 (B=1, H=8, D=64) the target is an overhead of at most 10 % of the kernels' time;
on tiny inputs (B=1, H=1, N=16, D=16) at most 15 µs per call. Medians of repeated runs, on
the seeded inputs of :mod:`flashcore.bench`. (``python -m flashcore bench --host-overhead``
times the whole call of each contender instead, peers included; this script splits a
flashcore call into glue and kernels.)

On a loaded or small machine the kernels' own time is noisy (numba's thread pool on busy
cores), which can swamp a difference of microseconds; ``--stub`` therefore also times the
glue alone: the dispatcher is made to return a stub backend that only allocates its
outputs, and wrapper and direct calls of that stub are compared. It also prints each
framework's floor, the same call through a bare ``torch.autograd.Function`` or a jitted
no-op ``buffer_callback``: what any glue costs before it does anything.

Usage::

    python tools/bench_wrappers.py [--device cpu|cuda] [--frameworks torch,jax]
                                   [--sizes tiny,4096] [--dtype float32] [--repeat 5]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time

import numpy as np

import flashcore
from flashcore import _dispatch, bench
from flashcore._checks import make_case

SIZES = {"tiny": (1, 1, 16, 16), "4096": (1, 8, 4096, 64)}  # B, H, N, D
TARGET_PCT, TARGET_US = 10.0, 15.0


def _block(fn, sync, inner):
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    sync()
    return (time.perf_counter() - t0) / inner


def _median_pair(wrapper, direct, sync, repeat, inner):
    """Medians over ``repeat`` blocks of ``inner`` calls each, in seconds; the two are timed
    in alternating blocks so that drift of a busy machine hits both alike."""
    for fn in (wrapper, direct):  # warm-up: compiles, caches
        fn()
    sync()
    tw, td = [], []
    for i in range(repeat):
        order = ((wrapper, tw), (direct, td)) if i % 2 == 0 else ((direct, td), (wrapper, tw))
        for fn, times in order:
            times.append(_block(fn, sync, inner))
    return statistics.median(tw), statistics.median(td)


class _Stub:
    """A backend that only allocates its outputs, in the arrays' library."""

    NAME = "stub"

    @staticmethod
    def forward(q, k, v, case):
        shape = (case.batch, case.heads_q, case.seqlen_q)
        if case.library == "torch":
            import torch

            return torch.empty_like(q), torch.empty(shape, dtype=torch.float32, device=q.device)
        return np.empty(q.shape, q.dtype), np.empty(shape, np.float32)

    @staticmethod
    def backward(do, q, k, v, o, lse, case):
        if case.library == "torch":
            import torch

            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        return np.empty(q.shape, q.dtype), np.empty(k.shape, k.dtype), np.empty(v.shape, v.dtype)


@contextlib.contextmanager
def _stubbed(on):
    real = _dispatch.select
    # The glue caches the backend it chose per shape: forget it on the way in and out.
    plans = [getattr(sys.modules.get(m), "_PLANS", {})
             for m in ("flashcore._torch_ops", "flashcore._jax_ops")]
    if on:
        _dispatch.select = lambda case, backend: _Stub
    for p in plans:
        p.clear()
    try:
        yield
    finally:
        _dispatch.select = real
        for p in plans:
            p.clear()


def _inner(size, device):
    return 200 if size == "tiny" else (20 if device == "cuda" else 1)


def _inputs(size, library, device, dtype):
    """The seeded ``(q, k, v, do)`` of :func:`flashcore.bench.host_inputs` for ``size``, as
    arrays of ``library``; RuntimeError (a skip) where that library cannot reach ``device``."""
    dev = "cuda:0" if device == "cuda" else "cpu"
    why = bench.library_reason(library, dev)
    if why is not None:
        raise RuntimeError(why)
    config = bench.Config(*SIZES[size], dtype=dtype)
    return tuple(bench.to_library(a, library, dev) for a in bench.host_inputs(config))


# --- PyTorch ----------------------------------------------------------------------------------


def bench_torch_floor(size, device, dtype, repeat):
    """torch's own minimum: a bare autograd.Function around the stub (no flashcore code)."""
    import torch

    B, H, N, D = SIZES[size]
    q, k, v, do = _inputs(size, "torch", device, dtype)
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    lse_shape = (B, H, N)

    class Bare(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ctx.save_for_backward(q, k, v)
            return torch.empty_like(q), torch.empty(lse_shape, device=q.device)

        @staticmethod
        def backward(ctx, do, _):
            q, k, v = ctx.saved_tensors
            return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def bare_fwd():
        Bare.apply(qg, kg, vg)

    def bare_fwd_bwd():
        torch.autograd.grad(Bare.apply(qg, kg, vg)[0], (qg, kg, vg), do)

    def direct_fwd():
        torch.empty_like(q), torch.empty(lse_shape, device=q.device)

    def direct_fwd_bwd():
        direct_fwd()
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    return "floor", _rows(bare_fwd, bare_fwd_bwd, direct_fwd, direct_fwd_bwd, sync, repeat,
                          _inner(size, device) * 5)


def bench_torch(size, device, dtype, repeat, stub=False):
    import torch

    q, k, v, do = _inputs(size, "torch", device, dtype)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True)
    impl = _Stub if stub else _dispatch.select(case, "auto")
    bcase = make_case(q, k, v, causal=False, scale=None, layout="bhnd", direction="backward",
                      extra={"do": do, "o": q, "lse": q[..., 0].float()})
    bimpl = _Stub if stub else _dispatch.select(bcase, "auto")
    qg, kg, vg = (x.clone().requires_grad_(True) for x in (q, k, v))

    def wrapper_fwd():
        flashcore.attention(qg, kg, vg)

    def wrapper_fwd_bwd():
        torch.autograd.grad(flashcore.attention(qg, kg, vg), (qg, kg, vg), do)

    def direct_fwd():
        impl.forward(q, k, v, case)

    def direct_fwd_bwd():
        o, lse = impl.forward(q, k, v, case)
        bimpl.backward(do, q, k, v, o, lse, bcase)

    inner = _inner(size, device) * (5 if stub else 1)
    with _stubbed(stub):
        return impl.NAME, _rows(wrapper_fwd, wrapper_fwd_bwd, direct_fwd, direct_fwd_bwd, sync,
                                repeat, inner)


def _rows(wrapper_fwd, wrapper_fwd_bwd, direct_fwd, direct_fwd_bwd, sync, repeat, inner):
    return [("fwd", *_median_pair(wrapper_fwd, direct_fwd, sync, repeat, inner)),
            ("fwd+bwd", *_median_pair(wrapper_fwd_bwd, direct_fwd_bwd, sync, repeat, inner))]


# --- JAX ----------------------------------------------------------------------------------------


def bench_jax_floor(size, device, dtype, repeat):
    """JAX's own minimum: a jitted function of one (two for fwd+bwd) no-op buffer_callback
    with the same operands and results (no flashcore code)."""
    import jax
    import jax.numpy as jnp
    from jax.experimental.buffer_callback import buffer_callback

    B, H, N, D = SIZES[size]
    q = _inputs(size, "jax", device, dtype)[0]
    o_t = jax.ShapeDtypeStruct(q.shape, q.dtype)
    lse_t = jax.ShapeDtypeStruct((B, H, N), jnp.float32)

    def noop(ctx, outs, *args):
        pass

    fwd_cb = buffer_callback(noop, (o_t, lse_t))
    bwd_cb = buffer_callback(noop, (o_t, o_t, o_t))
    fwd = jax.jit(lambda a, b, c: fwd_cb(a, b, c))

    @jax.jit
    def fwd_bwd(a, b, c, g):
        o, lse = fwd_cb(a, b, c)
        return bwd_cb(g, a, b, c, o, lse)

    def bare_fwd():
        jax.block_until_ready(fwd(q, q, q))

    def bare_fwd_bwd():
        jax.block_until_ready(fwd_bwd(q, q, q, q))

    def direct_fwd():
        np.empty(q.shape, q.dtype), np.empty((B, H, N), np.float32)

    def direct_fwd_bwd():
        direct_fwd()
        np.empty(q.shape, q.dtype), np.empty(q.shape, q.dtype), np.empty(q.shape, q.dtype)

    return "floor", _rows(bare_fwd, bare_fwd_bwd, direct_fwd, direct_fwd_bwd, lambda: None,
                          repeat, _inner(size, device) * 5)


def bench_jax(size, device, dtype, repeat, stub=False):
    import jax

    q, k, v, do = _inputs(size, "jax", device, dtype)
    case = make_case(q, k, v, causal=False, scale=None, layout="bhnd", need_lse=True)
    impl = _Stub if stub else _dispatch.select(case, "auto")
    o, lse = _dispatch.select(case, "auto").forward(q, k, v, case)
    bcase = make_case(q, k, v, causal=False, scale=None, layout="bhnd", direction="backward",
                      extra={"do": do, "o": o, "lse": lse})
    bimpl = _Stub if stub else _dispatch.select(bcase, "auto")

    def sync():
        pass

    fwd = jax.jit(lambda a, b, c: flashcore.attention(a, b, c))
    fwd_bwd = jax.jit(lambda a, b, c, g: jax.vjp(
        lambda x, y, z: flashcore.attention(x, y, z), a, b, c)[1](g))

    def wrapper_fwd():
        jax.block_until_ready(fwd(q, k, v))

    def wrapper_fwd_bwd():
        jax.block_until_ready(fwd_bwd(q, k, v, do))

    def direct_fwd():
        jax.block_until_ready(impl.forward(q, k, v, case))

    def direct_fwd_bwd():
        o, lse = impl.forward(q, k, v, case)
        jax.block_until_ready(bimpl.backward(do, q, k, v, o, lse, bcase))

    inner = _inner(size, device) * (5 if stub else 1)
    with _stubbed(stub):
        return impl.NAME, _rows(wrapper_fwd, wrapper_fwd_bwd, direct_fwd, direct_fwd_bwd, sync,
                                repeat, inner)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--frameworks", default="torch,jax")
    p.add_argument("--sizes", default="tiny,4096")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--stub", action="store_true",
                   help="also time the glue alone (stub kernels) and the framework's floor")
    a = p.parse_args(argv)
    benches = {"torch": bench_torch, "jax": bench_jax}
    floors = {"torch": bench_torch_floor, "jax": bench_jax_floor}
    print(f"{'framework':9} {'size':5} {'pass':8} {'backend':10} {'wrapper':>11} "
          f"{'direct':>11} {'overhead':>10} {'%':>7}  target")
    ok = True
    for fw in a.frameworks.split(","):
        for size in a.sizes.split(","):
            kernel = {}
            for stub in (False, True) if a.stub else (False,):
                if stub and fw == "jax" and a.device == "cuda":
                    # On the GPU the JAX glue launches the backend's kernels itself (into
                    # XLA's buffers): there is no stub to put in their place.
                    print(f"{fw:9} {size:5} (no stub rows: the GPU path needs real kernels)")
                    continue
                try:
                    name, rows = benches[fw](size, a.device, a.dtype, a.repeat, stub=stub)
                except (ImportError, RuntimeError) as e:  # missing framework or device
                    print(f"{fw:9} {size:5} skipped: {type(e).__name__}: {e}")
                    break
                for pass_, w, d in rows:
                    extra = w - d
                    if not stub:
                        kernel[pass_] = d
                    base = kernel.get(pass_, d)  # the glue's cost is judged against the kernels
                    pct = 100 * extra / base
                    good = pct <= TARGET_PCT if size != "tiny" else extra * 1e6 <= TARGET_US
                    ok &= good
                    target = (f"<= {TARGET_PCT:.0f} %" if size != "tiny" else
                              f"<= {TARGET_US:.0f} us")
                    print(f"{fw:9} {size:5} {pass_:8} {name:10} {_fmt(w):>11} {_fmt(d):>11} "
                          f"{extra * 1e6:8.1f}us {pct:6.1f}%  {target} "
                          f"{'ok' if good else 'MISSED'}")
            if a.stub and kernel:
                # The framework's own floor, for reading the stub rows: no glue can be cheaper.
                _, rows = floors[fw](size, a.device, a.dtype, a.repeat)
                for pass_, w, d in rows:
                    print(f"{fw:9} {size:5} {pass_:8} {'floor':10} {_fmt(w):>11} {_fmt(d):>11} "
                          f"{(w - d) * 1e6:8.1f}us {'':>7}  (the framework's minimum)")
    return 0 if ok else 1


def _fmt(seconds):
    return f"{seconds * 1e3:.3f} ms" if seconds >= 1e-3 else f"{seconds * 1e6:.1f} us"


if __name__ == "__main__":
    sys.exit(main())
