"""PyTorch autograd and ``torch.compile`` glue: the one place flashcore meets torch's dispatcher.

Three thin layers, as FlashAttention-2 has them:

1. raw ops registered with ``torch.library.custom_op``: ``flashcore::attention_forward``
   ``(q, k, v, causal, scale, layout, backend) -> (o, lse)`` and
   ``flashcore::attention_backward`` ``(do, q, k, v, o, lse, ...) -> (dq, dk, dv)``. Each
   checks its arguments, picks a kernel backend through :mod:`flashcore._dispatch` (CPU
   tensors normally go to ``numba_cpu`` through zero-copy host views, CUDA tensors to
   ``numba_cuda``) and calls it. ``register_fake`` gives ``torch.compile`` the output shapes,
   so a model that calls flashcore compiles with ``fullgraph=True``;
2. ``register_autograd``: the forward saves ``(q, k, v, o, lse)``; the backward calls the
   backward op. ``lse`` is returned as non-differentiable (as in FlashAttention-2);
3. :func:`attention`, which :func:`flashcore.attention` calls for torch tensors that need
   autograd or are being compiled.

This module imports torch at import time; ``flashcore`` imports it only when it meets a
torch tensor, so ``import flashcore`` still imports no framework.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace

import torch

from . import _dispatch
from ._checks import check_options, make_case
from ._errors import BackendUnavailableError

Tensor = torch.Tensor


_NO_DEVICE = contextlib.nullcontext()


def _on_device(t: Tensor):
    """Make ``t``'s device current, so kernels run on its current stream (not device 0's)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else _NO_DEVICE


def _dense(x: Tensor) -> Tensor:
    # register_fake promises contiguous outputs; backends may return strided views.
    return x if x.is_contiguous() else x.contiguous()


# --- layer 1: raw ops ---------------------------------------------------------------------


@torch.library.custom_op("flashcore::attention_forward", mutates_args=())
def attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                         layout: str, backend: str) -> tuple[Tensor, Tensor]:
    """``(o, lse)``: o of q's shape and dtype, lse float32 ``(B, Hq, Nq)``."""
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=True,
                     explicit=backend != "auto")
    with _on_device(q):
        o, lse = _dispatch.select(case, backend).forward(q, k, v, case)
    return _dense(o), _dense(lse)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, causal, scale, layout, backend):
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=True,
                     explicit=backend != "auto")
    lse = q.new_empty((case.batch, case.heads_q, case.seqlen_q), dtype=torch.float32)
    return q.new_empty(q.shape), lse


@torch.library.custom_op("flashcore::attention_backward", mutates_args=())
def attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                          causal: bool, scale: float, layout: str,
                          backend: str) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the shapes and dtypes of q, k, v."""
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, direction="backward",
                     explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse})
    with _on_device(q):
        grads = _dispatch.select(case, backend).backward(do, q, k, v, o, lse, case)
    return tuple(_dense(g) for g in grads)


@attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, causal, scale, layout, backend):
    make_case(q, k, v, causal=causal, scale=scale, layout=layout, direction="backward",
              explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse})
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --- layer 2: autograd ----------------------------------------------------------------------


def _setup_context(ctx, inputs, output):
    q, k, v, causal, scale, layout, backend = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.options = (causal, scale, layout, backend)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, do, _dlse):
    q, k, v, o, lse = ctx.saved_tensors
    # An output gradient can be an expanded view (stride 0) of a scalar's gradient.
    dq, dk, dv = attention_backward_op(do.contiguous(), q, k, v, o, lse, *ctx.options)
    return dq, dk, dv, None, None, None, None


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


# --- eager fast path -------------------------------------------------------------------------
# Outside torch.compile the custom op's Python dispatch costs ~70-100 µs a call. Eager calls
# therefore take a plain autograd.Function that runs the same backends with the same saved
# tensors, and the checked Case and chosen backends are cached per (types, shapes, dtypes,
# devices, options): make_case reads nothing else, so a hit skips only repeated work.

_PLANS: dict = {}
_MAX_PLANS = 512


def _plan(q, k, v, causal, scale, layout, backend, return_lse):
    key = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype,
           q.device, k.device, v.device, causal, scale, layout, backend, return_lse)
    try:
        hit = _PLANS.get(key)
    except TypeError:  # an unhashable option: make_case below says what is wrong with it
        hit = key = None
    if hit is None:
        hit = _make_plan(q, k, v, causal, scale, layout, backend, return_lse)
        if key is not None:
            if len(_PLANS) >= _MAX_PLANS:
                _PLANS.clear()
            _PLANS[key] = hit
    return hit


def _make_plan(q, k, v, causal, scale, layout, backend, return_lse):
    """(forward case, its backend, backward case, its backend)."""
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=True,
                     explicit=backend != "auto")
    try:
        impl = _dispatch.select(case, backend)
    except BackendUnavailableError:
        if return_lse or backend != "auto":
            raise
        # lse is only a residual here: a backend that cannot return it (torch SDPA in
        # float64 on CUDA) may serve the forward, and then the backward too, which it does
        # without lse.
        case = replace(case, need_lse=False)
        impl = _dispatch.select(case, backend)
        bcase = replace(case, direction="backward", explicit=True)
        return case, impl, bcase, _dispatch.select(bcase, impl.NAME)
    bcase = replace(case, direction="backward", need_lse=False)
    return case, impl, bcase, _dispatch.select(bcase, backend)


class _EagerAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan):
        case, impl, bcase, bimpl = plan
        with _on_device(q):
            o, lse = impl.forward(q, k, v, case)
        if lse is None:  # a backend that computes no lse (see _make_plan); never returned
            lse = o.new_full((case.batch, case.heads_q, case.seqlen_q), math.nan,
                             dtype=torch.float32)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.backward_plan = (bcase, bimpl)
        ctx.mark_non_differentiable(lse)
        # lse never has a gradient: do not let autograd build a zero tensor for it (~3 µs)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        if do is None:  # no gradient reached o (grads are not materialized): none for q, k, v
            return None, None, None, None
        q, k, v, o, lse = ctx.saved_tensors
        bcase, bimpl = ctx.backward_plan
        with _on_device(q):
            dq, dk, dv = bimpl.backward(do.contiguous(), q, k, v, o, lse, bcase)
        return dq, dk, dv, None


# --- layer 3: what flashcore.attention calls ------------------------------------------------


def static_scale(q, causal, scale, layout) -> float:
    """The scale as the custom ops take it (a float), checked; under torch.compile."""
    d = q.shape[-1] if isinstance(q, Tensor) and q.ndim == 4 else 0
    return check_options(causal=causal, scale=scale, layout=layout, head_dim=int(d))


def wants(q, k, v) -> bool:
    """True when torch tensors need this path: torch.compile is tracing, or autograd is
    recording and one of q, k, v requires grad."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in (q, k, v))


def attention(q, k, v, *, causal=False, scale=None, layout="bhnd", return_lse=False,
              backend="auto"):
    """Differentiable, compilable :func:`flashcore.attention` for torch tensors."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str); got {backend=}")
    if torch.compiler.is_compiling():
        # The custom op: dynamo traces it as one node (make_case cannot be traced itself).
        scale = static_scale(q, causal, scale, layout)
        o, lse = attention_forward_op(q, k, v, causal, scale, layout, backend)
        return (o, lse) if return_lse else o
    if backend == "torch":
        # SDPA is differentiable as it is: eager autograd goes through torch's own backward
        # kernels.
        from .backends import torch_sdpa

        case = make_case(q, k, v, causal=causal, scale=scale, layout=layout,
                         need_lse=return_lse, explicit=True)
        why = torch_sdpa.supports(case)
        if why is not None:
            raise BackendUnavailableError(f"backend 'torch' cannot serve this call: {why}")
        o, lse = torch_sdpa.forward(q, k, v, case)
        return (o, lse) if return_lse else o
    o, lse = _EagerAttention.apply(
        q, k, v, _plan(q, k, v, causal, scale, layout, backend, return_lse))
    return (o, lse) if return_lse else o
