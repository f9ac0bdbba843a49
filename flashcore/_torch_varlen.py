"""PyTorch glue of the packed calls: custom ops (so ``torch.compile`` traces them as one node
each) with autograd for varlen, and the KV-cache op that declares it mutates its caches.

- ``flashcore::attention_varlen_forward`` ``(q, k, v, cu_seqlens_q, cu_seqlens_k, ...) ->
  (o, lse)`` and ``flashcore::attention_varlen_backward`` ``(do, q, k, v, o, lse, ...) ->
  (dq, dk, dv)``; the forward registers the backward as its autograd formula (residuals
  ``q, k, v, o, lse`` and the offsets; lse is non-differentiable, as in FlashAttention 2).
- ``flashcore::attention_with_kvcache`` ``(q, k_cache!, v_cache!, cache_seqlens, k?, v?,
  block_table?, ...) -> (o, lse)`` with ``mutates_args=("k_cache", "v_cache")``: the new
  keys are written into the caches in place, and the compiler knows it. Eager calls run the
  backend directly (the same in-place write), without a trip through the dispatcher.

Options reach the ops as :mod:`flashcore._torch_ops` passes them (``mods`` and ``arrays``);
``max_seqlen_*`` as ints, -1 for "compute from the offsets".
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from . import _dispatch
from ._checks import check_options
from ._mods import options as _options
from ._packed_checks import make_kvcache_case, varlen_plan
from ._rules import lse_dtype
from ._torch_ops import _options as _op_options
from ._torch_ops import op_mods

Tensor = torch.Tensor


def _lse_dtype(q):
    return getattr(torch, lse_dtype(str(q.dtype).removeprefix("torch.")))


def _max(n):
    return None if n < 0 else n


def _scale(q, causal, scale):
    d = int(q.shape[-1]) if q.ndim >= 1 else 0
    return check_options(causal=causal, scale=scale, layout="bnhd", head_dim=d)


@torch.library.custom_op("flashcore::attention_varlen_forward", mutates_args=())
def varlen_forward_op(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                      cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                      causal: bool, scale: float, backend: str, mods: int,
                      arrays: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, lse)``: o like q, lse float32 ``(Hq, total_q)``."""
    case, impl = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, backend,
                             max_seqlen_q=_max(max_seqlen_q), max_seqlen_k=_max(max_seqlen_k),
                             causal=causal, scale=scale, need_lse=True,
                             explicit=backend != "auto", options=_op_options(mods, arrays))
    o, lse = impl.forward(q, k, v, case)
    return o.contiguous(), lse.contiguous()


@varlen_forward_op.register_fake
def _varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                         causal, scale, backend, mods, arrays):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=_lse_dtype(q))


@torch.library.custom_op("flashcore::attention_varlen_backward", mutates_args=())
def varlen_backward_op(do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor,
                       cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
                       max_seqlen_k: int, causal: bool, scale: float, backend: str, mods: int,
                       arrays: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    """``(dq, dk, dv)`` like q, k, v."""
    case, impl = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, backend,
                             max_seqlen_q=_max(max_seqlen_q), max_seqlen_k=_max(max_seqlen_k),
                             causal=causal, scale=scale, direction="backward",
                             explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse},
                             options=_op_options(mods, arrays))
    grads = impl.backward(do, q, k, v, o, lse, case)
    return tuple(g.contiguous() for g in grads)


@varlen_backward_op.register_fake
def _varlen_backward_fake(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                          max_seqlen_k, causal, scale, backend, mods, arrays):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, *rest = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.rest = rest
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _backward(ctx, do, _dlse):
    rest = ctx.rest
    nones = tuple([None] * len(x) if isinstance(x, list) else None for x in rest)
    if do is None:
        return (None,) * 5 + nones
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = varlen_backward_op(do.contiguous(), q, k, v, o, lse, cu_q, cu_k, *rest)
    return (dq, dk, dv, None, None, *nones)


varlen_forward_op.register_autograd(_backward, setup_context=_setup_context)


def wants(q, k, v) -> bool:
    """The op path: torch.compile is tracing, or autograd records a gradient of q, k or v."""
    if torch.compiler.is_compiling():
        return True
    return torch.is_grad_enabled() and any(
        isinstance(x, Tensor) and x.requires_grad for x in (q, k, v))


def _op_args(q, max_seqlen_q, max_seqlen_k, causal, scale, backend, opts):
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str); got {backend=}")
    options = _options(opts["window"], opts["softcap"], opts["alibi_slopes"],
                       opts["score_mod"], opts["mask_mod"], opts["mod_args"], None)
    m = (-1 if max_seqlen_q is None else max_seqlen_q, -1 if max_seqlen_k is None
         else max_seqlen_k)
    return (*m, causal, _scale(q, causal, scale), backend, *op_mods(options))


def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None, max_seqlen_k=None,
           causal=False, scale=None, backend="auto", **opts):
    """Differentiable, compilable varlen forward: ``(o, lse)``."""
    return varlen_forward_op(q, k, v, cu_seqlens_q, cu_seqlens_k,
                             *_op_args(q, max_seqlen_q, max_seqlen_k, causal, scale, backend,
                                       opts))


def varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                    max_seqlen_k=None, causal=False, scale=None, backend="auto", **opts):
    """The backward op (under torch.compile)."""
    return varlen_backward_op(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                              *_op_args(q, max_seqlen_q, max_seqlen_k, causal, scale, backend,
                                        opts))


# --- KV cache -------------------------------------------------------------------------------


@torch.library.custom_op("flashcore::attention_with_kvcache", mutates_args=("k_cache", "v_cache"))
def kvcache_op(q: Tensor, k_cache: Tensor, v_cache: Tensor, cache_seqlens: Tensor,
               k: Optional[Tensor], v: Optional[Tensor], block_table: Optional[Tensor],
               causal: bool, scale: float, num_splits: int, backend: str, mods: int,
               arrays: list[Tensor]) -> tuple[Tensor, Tensor]:
    """``(o, lse)``; writes k, v into k_cache, v_cache in place."""
    case = make_kvcache_case(q, k_cache, v_cache, cache_seqlens, k, v, block_table,
                             causal=causal, scale=scale, num_splits=num_splits, need_lse=True,
                             explicit=backend != "auto", options=_op_options(mods, arrays))
    o, lse = _dispatch.select(case, backend).forward(q, k_cache, v_cache, case)
    return o.contiguous(), lse.contiguous()


@kvcache_op.register_fake
def _kvcache_fake(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal, scale,
                  num_splits, backend, mods, arrays):
    B, Nq, Hq, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((B, Hq, Nq), dtype=_lse_dtype(q))


def kvcache(q, k_cache, v_cache, cache_seqlens, k, v, block_table, *, causal, scale,
            num_splits, backend, options):
    """The KV-cache op (under torch.compile): ``(o, lse)``."""
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a backend name (str); got {backend=}")
    if isinstance(cache_seqlens, np.ndarray):  # host lengths reach the op as a CPU tensor
        cache_seqlens = torch.from_numpy(cache_seqlens)
    return kvcache_op(q, k_cache, v_cache, cache_seqlens, k, v, block_table, causal,
                      _scale(q, causal, scale), num_splits, backend, *op_mods(options))
