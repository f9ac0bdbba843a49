"""PyTorch autograd and ``torch.compile`` glue: the one place flashcore meets torch's dispatcher.

Three thin layers, as FlashAttention-2 has them:

1. raw ops registered with ``torch.library.custom_op``: ``flashcore::attention_forward``
   ``(q, k, v, causal, scale, layout, backend) -> (o, lse)`` and
   ``flashcore::attention_backward`` ``(do, q, k, v, o, lse, ...) -> (dq, dk, dv)``. They
   run the backend :mod:`flashcore._dispatch` selects (CPU tensors normally go to
   ``numba_cpu`` through zero-copy host views, CUDA tensors to ``numba_cuda``);
   ``register_fake`` gives ``torch.compile`` the output shapes, so a model that calls
   flashcore compiles with ``fullgraph=True``;
2. the autograd wiring, written once (``_setup_context``, ``_backward``): the forward saves
   ``(q, k, v, o, lse)``, ``lse`` is non-differentiable (as in FlashAttention-2), the
   backward runs the backward kernels. The forward op registers the two as its autograd
   formula (what ``torch.compile`` traces and ``opcheck`` checks); eager calls reach them
   through :class:`_EagerAttention`, which runs the same kernels without a trip through
   torch's dispatcher (a tiny forward+backward through the op costs about 2.5 times the
   host time: 408 against 160 µs with a stub backend on a 2-core CPU host);
3. :func:`attention`, which :func:`flashcore.attention` calls for torch tensors that need
   autograd or are being compiled.

A backend whose forward is torch code that torch's autograd differentiates as it stands
(``"torch"``, SDPA) is called directly, with torch's own backward kernels, as the JAX glue
calls JAX code.

This module imports torch at import time; ``flashcore`` imports it only when it meets a
torch tensor, so ``import flashcore`` still imports no framework.
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from . import _dispatch, _mods, _rules
from ._checks import check_options, make_case
from ._errors import BackendUnavailableError
from ._memo import Memo, typed

Tensor = torch.Tensor

#: Backends whose forward stays on torch's autograd graph: called directly, not wired.
_DIFFERENTIABLE = ("torch",)

_NO_DEVICE = contextlib.nullcontext()


def _on_device(t: Tensor):
    """Make ``t``'s device current, so kernels run on its current stream (not device 0's)."""
    return torch.cuda.device(t.device) if t.device.type == "cuda" else _NO_DEVICE


def _dense(x: Tensor) -> Tensor:
    # register_fake promises contiguous outputs; backends may return strided views.
    return x if x.is_contiguous() else x.contiguous()


# --- plans: the checked call and the backends chosen for it -----------------------------------


class _Plan(NamedTuple):
    case: object  # the forward's Case
    impl: object  # its backend
    bcase: object  # the backward's Case (None for a _DIFFERENTIABLE backend)
    bimpl: object  # its backend


#: Plans per (types, shapes, dtypes, devices, options): make_case and the selection read
#: nothing else, so a hit skips only repeated work.
_PLANS = Memo(512)


def _plan(q, k, v, causal, scale, layout, backend, return_lse, options=None) -> _Plan:
    try:
        key = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, typed(causal), typed(scale), layout,
               backend, return_lse, _mods.options_key(options))
    except TypeError:  # an option that cannot key a dict: checked every time
        key = None
    plan = _PLANS.get_or_build(key, _make_plan, q, k, v, causal, scale, layout, backend,
                               return_lse, options)
    if options is None:
        return plan
    return plan._replace(case=_mods.with_arrays(plan.case, options),
                         bcase=plan.bcase and _mods.with_arrays(plan.bcase, options))


def _make_plan(q, k, v, causal, scale, layout, backend, return_lse, options) -> _Plan:
    """The forward keeps lse as the backward's residual, so it asks for it even when the
    caller does not; a backend that cannot give it may still serve such a call (see below)."""
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=True,
                     explicit=backend != "auto", options=options)
    try:
        impl = _dispatch.select(case, backend)
    except BackendUnavailableError:
        if return_lse:
            raise
        # lse is only a residual here: a backend that cannot return it (torch SDPA in
        # float64 on CUDA), named or chosen by "auto", may serve the forward, and then the
        # backward too, which it does without lse.
        case = replace(case, need_lse=False)
        impl = _dispatch.select(case, backend)
        if getattr(impl, "NAME", None) in _DIFFERENTIABLE:
            return _Plan(case, impl, None, None)
        bcase = replace(case, direction="backward", explicit=True)
        return _Plan(case, impl, bcase, _dispatch.select(bcase, impl.NAME))
    if getattr(impl, "NAME", None) in _DIFFERENTIABLE:
        # torch's autograd needs no residual: lse only if the caller wants it.
        return _Plan(replace(case, need_lse=return_lse), impl, None, None)
    bcase = replace(case, direction="backward", need_lse=False)
    return _Plan(case, impl, bcase, _dispatch.select(bcase, backend))


def _forward(q, k, v, case, impl):
    """``(o, lse)`` from the backend, on q's device; lse NaN where the backend computes none
    (a no-lse plan, see _make_plan: the backward then reads none)."""
    with _on_device(q):
        o, lse = impl.forward(q, k, v, case)
    if lse is None:
        lse = o.new_full((case.batch, case.heads_q, case.seqlen_q), math.nan,
                         dtype=_lse_dtype(case))
    return o, lse


def _lse_dtype(case):
    return getattr(torch, _rules.lse_dtype(case.dtype))


# --- layer 1: raw ops ---------------------------------------------------------------------


# Masks and score modifiers reach the ops as ``mods`` (a number standing for the static
# options: the ops take no Python functions) and ``arrays`` (the ALiBi slopes, then
# mod_args); -1 and [] for plain attention.

#: The static options by number, and numbers by their key.
_STATIC: list = []
_STATIC_IDS: dict = {}


def op_mods(options) -> tuple[int, list]:
    """``(mods, arrays)`` as the ops take them."""
    if options is None:
        return -1, []
    window = options["window"]
    n = _static_id(tuple(window) if isinstance(window, list) else window, options["softcap"],
                   options["alibi_slopes"] is not None, options["score_mod"],
                   options["mask_mod"], options["block_mask"])
    return n, _mods.arrays_of(options)


@torch._dynamo.assume_constant_result
def _static_id(window, softcap, has_alibi, score_mod, mask_mod, block_mask) -> int:
    """The number standing for these static options (registered on first sight; under
    torch.compile this runs at trace time, its result a constant of the graph)."""
    key = (window, softcap, has_alibi, score_mod, mask_mod, block_mask)
    n = _STATIC_IDS.get(key)
    if n is None:
        n = _STATIC_IDS[key] = len(_STATIC)
        _STATIC.append({"window": window, "softcap": softcap, "has_alibi": has_alibi,
                        "score_mod": score_mod, "mask_mod": mask_mod,
                        "block_mask": block_mask})
    return n


def _options(mods: int, arrays) -> dict | None:
    """The options an op's ``(mods, arrays)`` stand for."""
    if mods < 0:
        return None
    static = dict(_STATIC[mods])
    arrays = list(arrays)
    static["alibi_slopes"] = arrays.pop(0) if static.pop("has_alibi") else None
    static["mod_args"] = tuple(arrays)
    return static


@torch.library.custom_op("flashcore::attention_forward", mutates_args=())
def attention_forward_op(q: Tensor, k: Tensor, v: Tensor, causal: bool, scale: float,
                         layout: str, backend: str, mods: int,
                         arrays: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, lse)``: o of q's shape and dtype, lse ``(B, Hq, Nq)`` (float64 for float64
    inputs, float32 otherwise)."""
    plan = _plan(q, k, v, causal, scale, layout, backend, True, _options(mods, arrays))
    o, lse = _forward(q, k, v, plan.case, plan.impl)
    return _dense(o), _dense(lse)


@attention_forward_op.register_fake
def _attention_forward_fake(q, k, v, causal, scale, layout, backend, mods, arrays):
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=True,
                     explicit=backend != "auto", options=_options(mods, arrays))
    lse = q.new_empty((case.batch, case.heads_q, case.seqlen_q), dtype=_lse_dtype(case))
    return q.new_empty(q.shape), lse


@torch.library.custom_op("flashcore::attention_backward", mutates_args=())
def attention_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                          causal: bool, scale: float, layout: str, backend: str, mods: int,
                          arrays: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` in the shapes and dtypes of q, k, v."""
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, direction="backward",
                     explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse},
                     options=_options(mods, arrays))
    with _on_device(q):
        grads = _dispatch.select(case, backend).backward(do, q, k, v, o, lse, case)
    return tuple(_dense(g) for g in grads)


@attention_backward_op.register_fake
def _attention_backward_fake(do, q, k, v, o, lse, causal, scale, layout, backend, mods,
                             arrays):
    make_case(q, k, v, causal=causal, scale=scale, layout=layout, direction="backward",
              explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse},
              options=_options(mods, arrays))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# --- layer 2: autograd ----------------------------------------------------------------------
# The wiring is written once, as the two functions the forward op registers as its formula
# (what torch.compile traces and opcheck checks). Eager calls reach the same two functions
# through _EagerAttention, whose inputs are (q, k, v, plan): with the plan at hand the
# backward calls the chosen backend directly instead of the backward op.


def _setup_context(ctx, inputs, output):
    # inputs: the op's (q, k, v, causal, scale, layout, backend, mods, arrays), or eagerly
    # (q, k, v, plan)
    q, k, v, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.rest = rest
    ctx.mark_non_differentiable(lse)
    # lse never has a gradient: do not let autograd build a zero tensor for it (~3 µs)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, _dlse):
    rest = ctx.rest
    if do is None:  # no gradient reached o (grads are not materialized): none for q, k, v
        return (None, None, None, *_no_grads(rest))
    q, k, v, o, lse = ctx.saved_tensors
    # An output gradient can be an expanded view (stride 0) of a scalar's gradient.
    do = do.contiguous()
    if len(rest) == 1:  # eager: the plan's backend
        bcase, bimpl = rest[0].bcase, rest[0].bimpl
        with _on_device(q):
            dq, dk, dv = bimpl.backward(do, q, k, v, o, lse, bcase)
    else:  # the op's formula: the backward op, one node in a compiled graph
        dq, dk, dv = attention_backward_op(do, q, k, v, o, lse, *rest)
    return (dq, dk, dv, *_no_grads(rest))


def _no_grads(rest):
    """None per non-differentiable input; a list of them for the op's ``arrays``."""
    return tuple([None] * len(x) if isinstance(x, list) else None for x in rest)


attention_forward_op.register_autograd(_backward, setup_context=_setup_context)


class _EagerAttention(torch.autograd.Function):
    """Eager calls: the op's kernels and formula without torch's dispatcher. The forward
    takes ctx itself (no separate ``setup_context`` method): torch binds the arguments of a
    Function that has one through ``inspect.signature`` on every call, which measured
    +70 µs per call on a 2-core CPU host."""

    @staticmethod
    def forward(ctx, q, k, v, plan):
        output = _forward(q, k, v, plan.case, plan.impl)
        _setup_context(ctx, (q, k, v, plan), output)
        return output

    backward = staticmethod(_backward)


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
              backend="auto", options=None):
    """Differentiable, compilable :func:`flashcore.attention` for torch tensors."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str); got {backend=}")
    if torch.compiler.is_compiling():
        # The custom op: dynamo traces it as one node (make_case cannot be traced itself).
        scale = static_scale(q, causal, scale, layout)
        o, lse = attention_forward_op(q, k, v, causal, scale, layout, backend,
                                      *op_mods(options))
    else:
        plan = _plan(q, k, v, causal, scale, layout, backend, return_lse, options)
        if plan.bimpl is None:  # a _DIFFERENTIABLE backend: torch's autograd as it stands
            o, lse = plan.impl.forward(q, k, v, plan.case)
        else:
            o, lse = _EagerAttention.apply(q, k, v, plan)
    return (o, lse) if return_lse else o
