"""JAX autodiff and ``jit`` glue: the one place flashcore meets JAX's tracing machinery.

:func:`flashcore.attention` calls :func:`attention` for JAX arrays (tracers included). The
kernel backend is chosen by :mod:`flashcore._dispatch` from a description of the call:

- a backend written in JAX (``"jax"``; ``"reference"``, which is Array API code) is simply
  called: JAX traces, differentiates and batches it like any JAX code;
- a Numba backend (``numba_cpu``, ``numba_cuda``) runs behind a ``jax.custom_vjp`` whose
  residuals are ``(q, k, v, o, lse)`` and whose forward and backward are callbacks through
  ``jax.experimental.buffer_callback`` (jax >= 0.6.1). On the GPU it hands the kernels
  XLA's own stream and output buffers, so nothing is copied and nothing waits; on the CPU
  the callback sees NumPy views of XLA's buffers, calls the backend through
  :mod:`flashcore._dispatch` and writes the results into XLA's output buffers (an older
  JAX uses ``jax.pure_callback`` there, at about ten times the cost per call; on the GPU it
  gets a clear error). Under ``jax.vmap`` the callbacks see the mapped axes in front of the
  batch axis and fold them into it. Traced arrays carry no device: on a machine with a
  GPU each platform gets its own branch (``jax.lax.platform_dependent``), and XLA keeps the
  one it lowers for.

``lse`` is returned through ``lax.stop_gradient``: autodiff treats it as a constant (as
FlashAttention-2 does), so a gradient never silently misses its contribution.

Shapes, dtypes and options are checked at trace time by :func:`flashcore._checks.make_case`
on zero-byte NumPy stand-ins of the arrays (a tracer has a shape and dtype but no device
or data), so a mistake raises the usual TypeError/ValueError where the call is written.
"""
from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np

from . import _dispatch, _interop, _mods, _rules
from ._checks import check_array, make_case
from ._errors import BackendUnavailableError
from ._memo import Memo, typed

#: Backends written in JAX-traceable array code: called directly, differentiated by JAX.
_TRACEABLE = ("jax", "reference")


def _stand_in(x):
    """A zero-byte NumPy array with ``x``'s shape and dtype (for the argument checks)."""
    return np.broadcast_to(np.zeros((), dtype=np.dtype(x.dtype)), tuple(x.shape))


def _device(x):
    """``"cpu"``/``"cuda:N"`` of a concrete array; None for a tracer (no device until run)."""
    try:
        devs = x.devices()
    except jax.errors.ConcretizationTypeError:
        return None
    if len(devs) != 1:
        raise ValueError(f"JAX arrays sharded over several devices are not supported: {devs=}")
    (d,) = devs
    return "cpu" if d.platform == "cpu" else f"cuda:{d.id}"


def _stand_in_options(options):
    """The options with stand-ins for their arrays (checked as q's stand-in is), after the
    checks a stand-in would hide or that would otherwise run only in the host callback:
    mod_args a tuple, the arrays JAX or NumPy arrays, the user's mods compiling for them
    (a TypeError at the call, or at trace time under jit, not inside XLA's error)."""
    if options is None:
        return None
    out = dict(options)
    _mods.check_mod_args_tuple(out["mod_args"])
    named = [(f"mod_args[{n}]", a) for n, a in enumerate(out["mod_args"])]
    if out["alibi_slopes"] is not None:
        named.insert(0, ("alibi_slopes", out["alibi_slopes"]))
    for name, x in named:
        if not _is_jax(x) and check_array(name, x) != "numpy":
            raise TypeError(f"{name} must be a JAX (or NumPy) array in a call on JAX arrays; "
                            f"got {type(x).__module__}.{type(x).__qualname__}")
    if out["alibi_slopes"] is not None:
        out["alibi_slopes"] = _stand_in(out["alibi_slopes"])
    out["mod_args"] = tuple(_stand_in(a) for a in out["mod_args"])
    return out


def check_cpu_mods(name, case, device):
    """The user's mods compiled by Numba for the CPU when the call will run there on
    numba_cpu (``device`` "cpu"; ``case``'s mod_args stand-ins): a TypeError at the call, or at
    trace time under jit, not inside XLA's callback. Not for other backends or a GPU, whose
    mods are not the CPU's to judge (the reference runs them as Python; CUDA takes
    float16 mod_args)."""
    if name == "numba_cpu" and case.mods is not None and not device.startswith("cuda"):
        _mods.check_compiles(case.mods.score_mod, case.mods.mask_mod, case.mod_args)


def _is_jax(x):
    return isinstance(x, (jax.Array, jax.core.Tracer))


def _case(q, k, v, *, causal, scale, layout, need_lse, backend, extra=None, device=None,
          options=None):
    """The call's Case (library "jax"), checked on stand-ins; raises on bad arguments.
    ``device`` defaults to the arrays' own (where jit will run, for tracers)."""
    stand = {n: _stand_in(x) for n, x in (extra or {}).items()}
    case = make_case(_stand_in(q), _stand_in(k), _stand_in(v), causal=causal, scale=scale,
                     layout=layout, need_lse=need_lse, explicit=backend != "auto",
                     direction="backward" if extra else "forward", extra=stand or None,
                     options=_stand_in_options(options))
    if device is None:
        named = {"q": q, "k": k, "v": v, **(extra or {})}
        devices = {n: d for n, d in ((n, _device(x)) for n, x in named.items()) if d}
        if len(set(devices.values())) > 1:
            raise ValueError(f"all arrays must be on one device; got {devices}")
        device = next(iter(devices.values()), None) or (
            "cpu" if jax.default_backend() == "cpu" else "cuda:0")
    return replace(case, library="jax", device=device)


def attention(q, k, v, *, causal=False, scale=None, layout="bhnd", return_lse=False,
              backend="auto", options=None):
    """Differentiable, jit- and vmap-able :func:`flashcore.attention` for JAX arrays.
    The option arrays (ALiBi slopes, mod_args) are inputs of the custom VJP without
    gradients; under ``vmap`` they must not be mapped."""
    entries = plan(q, k, v, causal, scale, layout, backend, options)
    arrays = _mods.arrays_of(options)
    if len(entries) == 1:
        _, case, impl = entries[0]
        o, lse = _run(case, impl, q, k, v, *arrays, need_lse=return_lse)
    else:
        # Traced arrays on a machine with a GPU: whether this runs on the CPU or the GPU is
        # known only when jit lowers it, so each platform gets its own branch.
        o, lse = jax.lax.platform_dependent(
            q, k, v, *arrays, **{p: functools.partial(_run, case, impl, need_lse=True)
                                 for p, case, impl in entries})
    if lse is not None:
        lse = jax.lax.stop_gradient(lse)
    return (o, lse) if return_lse else o


def _run(case, impl, q, k, v, *arrays, need_lse):
    if impl.NAME in _TRACEABLE:
        return impl.forward(q, k, v, _with(replace(case, need_lse=need_lse), arrays))
    return _numba_attention(impl.NAME, case)(q, k, v, *arrays)


def _with(case, arrays):
    """``case`` carrying the option arrays (ALiBi slopes first, then mod_args)."""
    if case.mods is None:
        return case
    arrays = list(arrays)
    alibi = arrays.pop(0) if case.mods.alibi is not None else None
    return replace(case, alibi_slopes=alibi, mod_args=tuple(arrays))


#: Plans per kind of call; see plan.
_PLANS = Memo(512)


def plan(q, k, v, causal, scale, layout, backend, options=None):
    """``((platform, case, backend), ...)``: one entry (platform None) for concrete arrays
    or a CPU-only machine, one per platform for traced arrays on a machine with a GPU.
    Cached per (shapes, dtypes, devices, options): the checks read nothing else, so a
    cache hit skips only repeated work."""
    try:
        devices = tuple(_device(x) for x in (q, k, v))
    except ValueError:  # sharded: _case says so, every time
        devices = None
    key = None if devices is None else (
        tuple(q.shape), tuple(k.shape), tuple(v.shape), q.dtype, k.dtype, v.dtype, devices,
        typed(causal), typed(scale), layout, backend, jax.default_backend(),
        _options_key(options))
    traced = devices is not None and None in devices
    return _PLANS.get_or_build(key, _make_plan, q, k, v, causal, scale, layout, backend,
                               traced, options)


def _options_key(options):
    try:
        return _mods.options_key(options)
    except (TypeError, AttributeError):
        return object()  # not a key: a miss every time (the checks then say what is wrong)


def _make_plan(q, k, v, causal, scale, layout, backend, traced, options):
    opts = {"causal": causal, "scale": scale, "layout": layout, "need_lse": True,
            "backend": backend, "options": options}
    if not traced or jax.default_backend() == "cpu":
        case = _case(q, k, v, **opts)
        impl = _dispatch.select(case, backend)
        check_cpu_mods(impl.NAME, case, case.device)
        return ((None, case, impl),)
    entries, errors = [], []
    for platform, device in (("cuda", "cuda:0"), ("cpu", "cpu")):
        case = _case(q, k, v, device=device, **opts)
        try:
            entries.append((platform, case, _dispatch.select(case, backend)))
        except BackendUnavailableError as e:
            errors.append(e)
    if not entries:
        raise errors[0]  # the GPU's reasons: jit runs there unless the arrays say otherwise
    if len(entries) == 1:
        return ((None, *entries[0][1:]),)
    return tuple(entries)


# --- the custom_vjp around a Numba backend -----------------------------------------------


#: The traceable calls and the jitted custom-VJP function per (backend, Case): bounded like
#: the plans, so a serving loop whose sequence lengths keep changing does not keep a jitted
#: function for every length it ever saw.
_CALLS = Memo(256)
_ATTENTIONS = Memo(256)


def numba_calls(name: str, case):
    """``(forward, backward)`` of a Numba backend as traceable JAX calls for one Case:
    ``forward(q, k, v, *arrays) -> (o, lse)`` and ``backward(do, q, k, v, o, lse, *arrays)
    -> (dq, dk, dv)`` (no autodiff of their own; the ring's custom VJP calls them too)."""
    return _CALLS.get_or_build((name, case), _make_numba_calls, name, case)


def _make_numba_calls(name, case):
    o_type = jax.ShapeDtypeStruct(_shape(case, "q"), np.dtype(_dtype(case)))
    lse_type = jax.ShapeDtypeStruct((case.batch, case.heads_q, case.seqlen_q),
                                    np.dtype(_rules.lse_dtype(case.dtype)))
    kv_type = jax.ShapeDtypeStruct(_shape(case, "k"), np.dtype(_dtype(case)))
    fwd_types = (o_type, lse_type)
    bwd_types = (o_type, kv_type, kv_type)
    if case.on_gpu:
        fwd, bwd = _gpu_calls(name, case, fwd_types, bwd_types, lse_type)
    else:
        fwd, bwd = _cpu_calls(name, case, fwd_types, bwd_types)
    # (both platforms' callbacks take the option arrays as _per_batch gives them)
    return (lambda q, k, v, *arrays: fwd(q, k, v, *_per_batch(case, arrays)),
            lambda do, q, k, v, o, lse, *arrays: bwd(do, q, k, v, o, lse,
                                                     *_per_batch(case, arrays)))


def _numba_attention(name: str, case):
    """``f(q, k, v) -> (o, lse)`` with a custom VJP, for one backend and one Case."""
    return _ATTENTIONS.get_or_build((name, case), _make_numba_attention, name, case)


def _make_numba_attention(name, case):
    fwd_call, bwd_call = numba_calls(name, case)

    @jax.custom_vjp
    def f(q, k, v, *arrays):
        return fwd_call(q, k, v, *arrays)

    def f_fwd(q, k, v, *arrays):
        o, lse = fwd_call(q, k, v, *arrays)
        return (o, lse), (q, k, v, o, lse, arrays)

    def f_bwd(res, cts):
        do, _ = cts  # lse leaves through stop_gradient: its cotangent is zero
        q, k, v, o, lse, arrays = res
        # No gradient reaches the option arrays (ALiBi slopes, mod_args).
        return (*bwd_call(do, q, k, v, o, lse, *arrays), *map(_no_cotangent, arrays))

    f.defvjp(f_fwd, f_bwd)
    # Eager calls then run one compiled executable; under an outer jit this is inlined.
    return jax.jit(f)


def _no_cotangent(x):
    if jnp.issubdtype(x.dtype, jnp.inexact):
        return jnp.zeros_like(x)
    return np.zeros(x.shape, dtype=jax.dtypes.float0)


def _shape(case, which):
    B, N = case.batch, case.seqlen_q if which == "q" else case.seqlen_k
    H = case.heads_q if which == "q" else case.heads_kv
    return (B, H, N, case.head_dim) if case.layout == "bhnd" else (B, N, H, case.head_dim)


def _dtype(case):
    if case.dtype == "bfloat16":
        return jnp.bfloat16
    return case.dtype


def _fold(x, ndim):
    """Fold leading (vmapped) axes into the batch axis: (V..., B, ...) -> (V*B, ...)."""
    x = np.asarray(x)
    return x.reshape((-1, *x.shape[x.ndim - ndim + 1:])) if x.ndim > ndim else x


def _n_slopes(case) -> int:
    """1 where the call's option arrays start with ALiBi slopes, else 0."""
    return 1 if case.mods is not None and case.mods.alibi is not None else 0


def _per_batch(case, arrays):
    """The option arrays as the callbacks take them: slopes (Hq,) or (B, Hq) as (B, Hq),
    so that vmapped axes, which the callbacks' ``broadcast_all`` puts in front of every
    input, fold into the batch as they do for q; the mod_args as they are."""
    n = _n_slopes(case)
    slopes = tuple(jnp.broadcast_to(a, (case.batch, case.heads_q)) for a in arrays[:n])
    return (*slopes, *arrays[n:])


def _cpu_calls(name, case, fwd_types, bwd_types):
    """Forward and backward as host callbacks that call the backend chosen by name through
    the dispatcher. ``buffer_callback`` (jax >= 0.6.1) where JAX has it: it lends XLA's
    buffers in place and costs about a tenth of ``pure_callback`` per call; else
    ``pure_callback``."""
    opts = {"causal": case.causal, "scale": case.scale, "layout": case.layout}
    plans = {}  # the checked host Case and backend, per (direction, shapes, dtype)
    n_slopes = _n_slopes(case)
    arg_dims = tuple(len(a.shape) for a in case.mod_args)

    def host_arrays(arrays):
        # Under vmap the slopes ((B, Hq): _per_batch) fold into the batch as q does; the
        # mod_args are not mapped (attention's rule), so broadcast_all's copies in front
        # are all the same: the first one.
        slopes = [_fold(a, 2) for a in arrays[:n_slopes]]
        margs = []
        for i, (a, n) in enumerate(zip(arrays[n_slopes:], arg_dims)):
            a = np.asarray(a)
            first = a[(0,) * (a.ndim - n) + (Ellipsis,)]
            if a.ndim > n and not np.array_equal(a, np.broadcast_to(first, a.shape),
                                                 equal_nan=True):
                raise ValueError(f"mod_args[{i}] is mapped under jax.vmap; the mod_args "
                                 f"must not be (close over them, or fold the mapped axis "
                                 f"into an index the mods compute)")
            margs.append(first)
        return (*slopes, *margs)

    def host_plan(direction, q4, k4, v4, arrays, extra=None):
        key = (direction, q4.shape, k4.shape, q4.dtype)
        options = _host_options(case, host_arrays(arrays))
        hit = plans.get(key)
        if hit is None:
            host = make_case(q4, k4, v4, direction=direction, need_lse=direction == "forward",
                             explicit=case.explicit, extra=extra, options=options, **opts)
            hit = plans[key] = (host, _dispatch.select(host, name))
        return _mods.with_arrays(hit[0], options), hit[1]

    def fwd_host(q, k, v, *arrays):
        q4, k4, v4 = (_fold(x, 4) for x in (q, k, v))
        host, impl = host_plan("forward", q4, k4, v4, arrays)
        o, lse = impl.forward(q4, k4, v4, host)
        lse = np.asarray(lse, dtype=_rules.lse_dtype(host.dtype))
        return (np.asarray(o, dtype=q4.dtype).reshape(np.shape(q)),
                lse.reshape(*np.shape(q)[:-3], *np.shape(lse)[1:]))

    def bwd_host(do, q, k, v, o, lse, *arrays):
        do4, q4, k4, v4, o4 = (_fold(x, 4) for x in (do, q, k, v, o))
        lse3 = _fold(lse, 3)
        host, impl = host_plan("backward", q4, k4, v4, arrays,
                               {"do": do4, "o": o4, "lse": lse3})
        grads = impl.backward(do4, q4, k4, v4, o4, lse3, host)
        return tuple(np.asarray(g, dtype=x4.dtype).reshape(np.shape(x))
                     for g, x4, x in zip(grads, (q4, k4, v4), (q, k, v)))

    try:
        buffer_callback = _buffer_callback()
    except BackendUnavailableError:
        buffer_callback = None

    if buffer_callback is None:
        def fwd_call(q, k, v, *arrays):
            return jax.pure_callback(fwd_host, fwd_types, q, k, v, *arrays,
                                     vmap_method="broadcast_all")

        def bwd_call(do, q, k, v, o, lse, *arrays):
            return jax.pure_callback(bwd_host, bwd_types, do, q, k, v, o, lse, *arrays,
                                     vmap_method="broadcast_all")

        return fwd_call, bwd_call

    def into(outs, results):
        for out, r in zip(outs, results):
            np.copyto(np.asarray(out), r)

    def fwd_cb(ctx, outs, *inputs):
        into(outs, fwd_host(*map(np.asarray, inputs)))

    def bwd_cb(ctx, outs, *inputs):
        into(outs, bwd_host(*map(np.asarray, inputs)))

    fwd = buffer_callback(fwd_cb, fwd_types, vmap_method="broadcast_all")
    bwd = buffer_callback(bwd_cb, bwd_types, vmap_method="broadcast_all")
    return fwd, bwd


def _host_options(case, arrays):
    """The call's options (None: plain) with the callback's host arrays."""
    if case.mods is None:
        return None
    m, arrays = case.mods, list(arrays)
    return {"window": m.window, "softcap": m.softcap,
            "alibi_slopes": arrays.pop(0) if m.alibi is not None else None,
            "score_mod": m.score_mod, "mask_mod": m.mask_mod, "mod_args": tuple(arrays),
            "block_mask": m.block_mask}


# --- GPU: buffer_callback on XLA's stream -------------------------------------------------


def _buffer_callback():
    try:
        from jax.experimental.buffer_callback import buffer_callback
    except ImportError as e:
        raise BackendUnavailableError(
            f"flashcore's GPU kernels under JAX need jax.experimental.buffer_callback "
            f"(jax >= 0.6.1); this is jax {jax.__version__}. Upgrade JAX, or pass "
            f"backend='jax' to use JAX's own attention") from e
    return buffer_callback


def _xla_view(x, keep):
    """(address, strides in elements) of an XLA buffer wrapped in :class:`_Folded`."""
    ptr, strides = _interop.cuda_raw(x.buf, keep)
    return ptr, tuple(strides[len(strides) - x.ndim_core:])


def _gpu_launcher(name):
    """``make(outputs, stream)``: the named backend's launcher on XLA's buffers (its
    ``buffer_launcher`` contract hook), writing into the output buffers XLA allocated, on
    XLA's stream."""
    impl = _dispatch.load(name)
    hook = getattr(impl, "buffer_launcher", None)
    if hook is None:
        raise BackendUnavailableError(
            f"backend {name!r} cannot run inside jax.jit on a GPU (it has no raw-buffer "
            f"launcher); pass backend='jax' or backend='numba_cuda'")
    return lambda outs, stream: hook(_xla_view, outs, stream)


def _gpu_calls(name, case, fwd_types, bwd_types, lse_type):
    """Forward and backward through ``buffer_callback`` (kernels on XLA's stream)."""
    buffer_callback = _buffer_callback()
    launcher = _gpu_launcher(name)

    def host_case(q, direction):
        lead = int(np.prod(q.shape[:-4])) if len(q.shape) > 4 else 1
        dev = q.__dlpack_device__()[1]
        return replace(case, batch=case.batch * lead, device=f"cuda:{dev}",
                       direction=direction, need_lse=True)

    n_slopes = _n_slopes(case)
    arg_dims = tuple(len(a.shape) for a in case.mod_args)

    def with_options(c, arrays):
        # The option arrays: ALiBi slopes (broadcast to (B, Hq) by _per_batch, so
        # vmapped axes fold into the batch as q's do), then the mod_args. The mod_args are
        # not mapped under vmap (attention's rule): broadcast_all repeats them in front, and
        # folding those copies into their first axis leaves every index the mods compute
        # (row-major, from the trailing extents) on the first copy.
        if not arrays:
            return c
        slopes = _Folded(arrays[0], 2) if n_slopes else None
        margs = tuple(_Folded(a, n) for a, n in zip(arrays[n_slopes:], arg_dims))
        return replace(c, alibi_slopes=slopes, mod_args=margs)

    def fwd_cb(ctx, out, q, k, v, *arrays):
        o, lse = out
        c = with_options(host_case(q, "forward"), arrays)
        run = launcher([_Folded(o, 4), _Folded(lse, 3)], ctx.stream)
        run.forward(_Folded(q, 4), _Folded(k, 4), _Folded(v, 4), c)

    def bwd_cb(ctx, out, do, q, k, v, o, lse, *arrays):
        dq, dk, dv, delta = out
        c = with_options(host_case(q, "backward"), arrays)
        run = launcher([_Folded(dq, 4), _Folded(dk, 4), _Folded(dv, 4), _Folded(delta, 3)],
                       ctx.stream)
        run.backward(*(_Folded(x, 4) for x in (do, q, k, v, o)), _Folded(lse, 3), c)

    # scratch: D = rowsum(dO * O), float32 (B, Hq, Nq); the GPU kernels take no float64
    delta_type = jax.ShapeDtypeStruct(lse_type.shape, np.float32)
    fwd = buffer_callback(fwd_cb, fwd_types, vmap_method="broadcast_all")
    bwd = buffer_callback(bwd_cb, (*bwd_types, delta_type), vmap_method="broadcast_all")

    def bwd_call(do, q, k, v, o, lse, *arrays):
        dq, dk, dv, _ = bwd(do, q, k, v, o, lse, *arrays)
        return dq, dk, dv

    return fwd, bwd_call


class _Folded:
    """An XLA buffer seen with its leading (vmapped) axes folded into the batch axis: XLA's
    buffers are dense and row-major, so the batch stride serves the folded axis too."""

    def __init__(self, buf, ndim_core):
        self.buf, self.ndim_core = buf, ndim_core
        lead = len(buf.shape) - ndim_core + 1
        self.shape = (int(np.prod(buf.shape[:lead])), *buf.shape[lead:])
        self.dtype = buf.dtype
