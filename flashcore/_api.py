"""The public functions. They check arguments, pick a backend and hand the arrays over."""
from __future__ import annotations

from . import _dispatch
from ._checks import check_flag, make_case
from ._memo import Memo, typed
from ._mods import options as _options
from ._mods import options_key, with_arrays


def _framework(*arrays):
    """"torch" or "jax" when every array belongs to that framework, else None.

    A framework is looked for only if already imported (no array of it can exist otherwise);
    mixed inputs give None and reach the checks, which name what was mixed."""
    import sys

    torch, jax = sys.modules.get("torch"), sys.modules.get("jax")
    if torch is not None and all(isinstance(x, torch.Tensor) for x in arrays):
        return "torch"
    if jax is not None and all(isinstance(x, jax.Array) for x in arrays):
        return "jax"
    return None


#: Plans per kind of call; see _plan.
_PLANS = Memo(256)


def _plan(q, k, v, causal, scale, layout, need_lse, backend, options=None):
    """``(case, backend module)`` of a forward call: checked and selected once per kind of
    call (array types, shapes, dtypes, devices and options, which are all the checks and
    the selection read), then looked up, since on tiny inputs they cost more host time than
    the kernel launch. Arrays whose attributes cannot key a dict are checked every time.
    The arrays the options carry (alibi slopes, mod_args) join the case per call."""
    try:
        key = (type(q), type(k), type(v), q.shape, k.shape, v.shape, q.dtype, k.dtype,
               v.dtype, q.device, k.device, v.device, typed(causal), typed(scale), layout,
               need_lse, backend, options_key(options))
    except (AttributeError, TypeError):  # no .device, or a mod_args entry that is no array
        key = None
    case, impl = _PLANS.get_or_build(key, _make_plan, q, k, v, causal, scale, layout,
                                     need_lse, backend, options)
    return with_arrays(case, options), impl


def _make_plan(q, k, v, causal, scale, layout, need_lse, backend, options):
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, need_lse=need_lse,
                     explicit=backend != "auto", options=options)
    return case, _dispatch.select(case, backend)


def _torch_compiling():
    import torch

    return torch.compiler.is_compiling()


def _jax_traced(*arrays):
    import jax

    return any(isinstance(x, jax.core.Tracer) for x in arrays)


_MODS_DOC = """
    causal : bool
        Mask aligned to the bottom right: query ``i`` sees key ``j`` iff
        ``j <= i + (Nk - Nq)``. For ``Nq=2, Nk=4``::

            q0: x x x .
            q1: x x x x

        A query row that sees no key gets output 0 and ``lse = -inf``.
    window : (left, right), optional
        Sliding window around the same diagonal ``i' = i + Nk - Nq``: key ``j`` is hidden
        where ``j < i' - left`` or ``j > i' + right``; ``None`` for a side leaves it
        unbounded (FlashAttention's ``window_size`` with ``-1`` spelled ``None``).
    softcap : float, optional
        ``s = softcap * tanh(s / softcap)`` on the scaled score (Gemma 2, Grok).
    alibi_slopes : float32 array ``(Hq,)`` or ``(B, Hq)``, optional
        ``s += -slope[b, h] * |i' - j|`` (after the softcap).
    score_mod : function, optional
        ``score_mod(s, b, h, i, j, *mod_args) -> float``, applied last to the score (``h``
        the query head, ``i``, ``j`` the raw row and column). Plain Python of scalars that
        Numba compiles into the kernels; gradients flow through it (its derivative in ``s``
        is taken by a float64 finite difference, ``flashcore._mods``).
    mask_mod : function, optional
        ``mask_mod(b, h, i, j, *mod_args) -> bool``: False hides key ``j`` from query ``i``.
    mod_args : tuple of arrays
        Read by the mods by index (e.g. document ids ``(B, N)``); q's library and device.
    block_mask : BlockMask, optional
        :func:`flashcore.create_block_mask` of ``mask_mod`` for these sizes: repeated calls
        skip evaluating the mask per tile. Tiles every query of which is masked are skipped
        with or without it; full tiles skip the per-element mask.
    scale : float, optional
        Multiplies ``q kᵀ``; defaults to ``1/sqrt(D)``."""


def attention_forward(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None,
                      score_mod=None, mask_mod=None, mod_args=(), block_mask=None, scale=None,
                      layout="bhnd", backend="auto"):
    """Forward pass of exact attention; returns ``(o, lse)``.

    Parameters
    ----------
    q : array, ``(B, Hq, Nq, D)`` for ``layout="bhnd"`` or ``(B, Nq, Hq, D)`` for ``"bnhd"``
    k, v : arrays, ``(B, Hkv, Nk, D)`` or ``(B, Nk, Hkv, D)``; ``Hq`` a multiple of ``Hkv``
        (query head ``h`` reads key/value head ``h // (Hq // Hkv)``).{mods}
    layout : {{"bhnd", "bnhd"}}
    backend : {{"auto", "numba_cuda", "numba_cpu", "torch", "jax", "reference"}}

    Returns
    -------
    o : array of q's shape, dtype, library and device
    lse : array ``(B, Hq, Nq)``, the log-sum-exp of each row's final scores: float64 for
        float64 inputs, float32 otherwise
    """
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args,
                       block_mask)
    fw = _framework(q, k, v)
    if (fw == "torch" and _torch_compiling()) or (fw == "jax" and _jax_traced(q, k, v)):
        # Under torch.compile or jax.jit the arrays cannot be inspected: the framework glue
        # (a custom op, a JAX callback) carries the call.
        return attention(q, k, v, causal=causal, scale=scale, layout=layout, return_lse=True,
                         backend=backend, **(options or {}))
    case, impl = _plan(q, k, v, causal, scale, layout, True, backend, options)
    return impl.forward(q, k, v, case)


attention_forward.__doc__ = attention_forward.__doc__.format(mods=_MODS_DOC)


def attention_backward(do, q, k, v, o, lse, *, causal=False, window=None, softcap=None,
                       alibi_slopes=None, score_mod=None, mask_mod=None, mod_args=(),
                       block_mask=None, scale=None, layout="bhnd", backend="auto"):
    """Backward pass: gradients ``(dq, dk, dv)`` of attention for the output gradient ``do``.

    ``o`` and ``lse`` are what :func:`attention_forward` returned for the same q, k, v and
    options (pass the same masks and score modifiers). ``dq`` has q's shape and dtype,
    ``dk`` and ``dv`` k's. Two passes, no atomics: the same inputs give bitwise the same
    gradients. No gradient flows to ``alibi_slopes`` or ``mod_args``.
    """
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args,
                       block_mask)
    fw = _framework(do, q, k, v, o, lse)
    if fw == "torch" and _torch_compiling():
        from . import _torch_ops

        scale = _torch_ops.static_scale(q, causal, scale, layout)
        return _torch_ops.attention_backward_op(do, q, k, v, o, lse, causal, scale, layout,
                                                backend, *_torch_ops.op_mods(options))
    if fw == "jax" and _jax_traced(do, q, k, v, o, lse):
        # Traced: pull do back through the differentiable forward (it recomputes o and lse,
        # which a traced call cannot check against the ones given).
        import jax

        _, pullback = jax.vjp(lambda q, k, v: attention(
            q, k, v, causal=causal, scale=scale, layout=layout, backend=backend,
            **(options or {})), q, k, v)
        return pullback(do)
    case = make_case(q, k, v, causal=causal, scale=scale, layout=layout, direction="backward",
                     explicit=backend != "auto", extra={"do": do, "o": o, "lse": lse},
                     options=options)
    return _dispatch.select(case, backend).backward(do, q, k, v, o, lse, case)


def attention(q, k, v, *, causal=False, window=None, softcap=None, alibi_slopes=None,
              score_mod=None, mask_mod=None, mod_args=(), block_mask=None, scale=None,
              layout="bhnd", return_lse=False, backend="auto"):
    """Exact attention ``softmax(mods(q kᵀ · scale)) v`` without materializing the score
    matrix.

    Takes and returns arrays of any Array API library (NumPy, PyTorch, JAX, CuPy); see
    :func:`attention_forward` for shapes and options (masks and score modifiers). Returns
    ``o``, or ``(o, lse)`` with ``return_lse=True``. Differentiable where the library has
    autodiff (PyTorch, JAX), with respect to q, k and v.
    """
    check_flag("return_lse", return_lse)
    options = _options(window, softcap, alibi_slopes, score_mod, mask_mod, mod_args,
                       block_mask)
    # Framework autodiff and compilation live in one module per framework.
    fw = _framework(q, k, v)
    if fw == "torch":
        from . import _torch_ops

        if _torch_ops.wants(q, k, v):
            return _torch_ops.attention(q, k, v, causal=causal, scale=scale, layout=layout,
                                        return_lse=return_lse, backend=backend,
                                        options=options)
    elif fw == "jax":
        from . import _jax_ops

        return _jax_ops.attention(q, k, v, causal=causal, scale=scale, layout=layout,
                                  return_lse=return_lse, backend=backend, options=options)
    case, impl = _plan(q, k, v, causal, scale, layout, return_lse, backend, options)
    o, lse = impl.forward(q, k, v, case)
    return (o, lse) if return_lse else o


def available_backends() -> dict:
    """``{name: None if the backend can run here, else the reason it cannot}``."""
    return _dispatch.available_backends()
