"""Packed variable-length batches: ``attention_varlen`` and its forward and backward.

Sequences of different lengths are packed one after another along the token axis, with
no padding: q ``(total_q, Hq, D)``, k and v ``(total_k, Hkv, D)``, and ``cu_seqlens_*`` the
offsets (FlashAttention 2's ``flash_attn_varlen_func``). Each sequence is attended on its
own, with every rule of :func:`flashcore.attention`.
"""
from __future__ import annotations

from ._api import _framework, _jax_traced, _torch_compiling
from ._checks import check_flag
from ._mods import options as _options
from ._packed_checks import varlen_plan

_DOC = """
    Parameters
    ----------
    q : array ``(total_q, Hq, D)``
        The query rows of every sequence, one sequence after another.
    k, v : arrays ``(total_k, Hkv, D)``; ``Hq`` a multiple of ``Hkv`` (GQA).
    cu_seqlens_q, cu_seqlens_k : int32 arrays ``(batch + 1,)``
        Offsets: sequence ``s`` is rows ``cu[s]:cu[s+1]``; from 0, non-decreasing, ending at
        ``total_q`` / ``total_k``; the same length. Empty sequences are allowed.
    max_seqlen_q, max_seqlen_k : int, optional
        The longest sequence (at least); computed on the host from the offsets when not
        given (where it is given, it is still checked against them).
    causal : bool
        Bottom-right causal per sequence: query ``i`` of sequence ``s`` sees key ``j`` iff
        ``j <= i + n_k(s) - n_q(s)``; a row that sees no key gives 0 and lse ``-inf``.
    window, softcap, alibi_slopes, score_mod, mask_mod, mod_args
        As for :func:`flashcore.attention`, per sequence: ``i``, ``j`` are positions within
        the sequence and the mods' ``b`` is the sequence index; ``alibi_slopes`` is ``(Hq,)``
        or ``(batch, Hq)``.
    scale : float, optional
        Defaults to ``1/sqrt(D)``.
    backend : {"auto", "numba_cuda", "numba_cpu", "reference"}
        numba_cuda serves torch, CuPy and JAX GPU arrays (tensor cores for fp16/bf16);
        torch and jax decline packed calls.
"""


def attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                             max_seqlen_k=None, causal=False, window=None, softcap=None,
                             alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(),
                             scale=None, backend="auto"):
    """Forward pass of attention over packed sequences; returns ``(o, lse)``: ``o`` like q,
    ``lse`` float32 ``(Hq, total_q)`` (FlashAttention 2's layout).
    {doc}"""
    fw = _framework(q, k, v)
    if (fw == "torch" and _torch_compiling()) or (fw == "jax" and _jax_traced(q, k, v)):
        return attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                                max_seqlen_k=max_seqlen_k, causal=causal, window=window,
                                softcap=softcap, alibi_slopes=alibi_slopes,
                                score_mod=score_mod, mask_mod=mask_mod, mod_args=mod_args,
                                scale=scale, return_lse=True, backend=backend)
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, None)
    case, impl = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, backend,
                             max_seqlen_q=max_seqlen_q, max_seqlen_k=max_seqlen_k,
                             causal=causal, scale=scale, need_lse=True,
                             explicit=backend != "auto", options=options)
    return impl.forward(q, k, v, case)


def attention_varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k, *,
                              max_seqlen_q=None, max_seqlen_k=None, causal=False, window=None,
                              softcap=None, alibi_slopes=None, score_mod=None, mask_mod=None,
                              mod_args=(), scale=None, backend="auto"):
    """Gradients ``(dq, dk, dv)`` of :func:`attention_varlen` for the output gradient ``do``,
    given the ``o`` and ``lse`` (``(Hq, total_q)``) the forward returned with the same
    arguments. Two passes, no atomics (deterministic). No gradient flows to
    ``alibi_slopes`` or ``mod_args``."""
    kw = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "causal": causal,
          "scale": scale}
    opts = {"window": window, "softcap": softcap, "alibi_slopes": alibi_slopes,
            "score_mod": score_mod, "mask_mod": mask_mod, "mod_args": mod_args}
    fw = _framework(do, q, k, v, o, lse)
    if fw == "torch" and _torch_compiling():
        from . import _torch_varlen

        return _torch_varlen.varlen_backward(do, q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
                                             backend=backend, **kw, **opts)
    if fw == "jax" and _jax_traced(do, q, k, v, o, lse):
        # Traced: pull do back through the differentiable forward (it recomputes o and lse).
        import jax

        _, pullback = jax.vjp(lambda q, k, v: attention_varlen(
            q, k, v, cu_seqlens_q, cu_seqlens_k, backend=backend, **kw, **opts), q, k, v)
        return pullback(do)
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args, None)
    case, impl = varlen_plan(q, k, v, cu_seqlens_q, cu_seqlens_k, backend,
                             direction="backward", explicit=backend != "auto",
                             extra={"do": do, "o": o, "lse": lse}, options=options, **kw)
    return impl.backward(do, q, k, v, o, lse, case)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, max_seqlen_q=None,
                     max_seqlen_k=None, causal=False, window=None, softcap=None,
                     alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(), scale=None,
                     return_lse=False, backend="auto"):
    """Exact attention over packed variable-length sequences (no padding); returns ``o``
    ``(total_q, Hq, D)``, or ``(o, lse)`` with ``return_lse=True``. Differentiable in
    PyTorch and JAX with respect to q, k and v (``lse`` carries no gradient).
    {doc}"""
    check_flag("return_lse", return_lse)
    kw = {"max_seqlen_q": max_seqlen_q, "max_seqlen_k": max_seqlen_k, "causal": causal,
          "window": window, "softcap": softcap, "alibi_slopes": alibi_slopes,
          "score_mod": score_mod, "mask_mod": mask_mod, "mod_args": mod_args, "scale": scale,
          "backend": backend}
    fw = _framework(q, k, v)
    if fw == "torch":
        from . import _torch_varlen

        if _torch_varlen.wants(q, k, v):
            o, lse = _torch_varlen.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
            return (o, lse) if return_lse else o
    elif fw == "jax":
        from . import _jax_varlen

        o, lse = _jax_varlen.varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
        return (o, lse) if return_lse else o
    o, lse = attention_varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, **kw)
    return (o, lse) if return_lse else o


for _f in (attention_varlen_forward, attention_varlen):
    _f.__doc__ = _f.__doc__.format(doc=_DOC)
