"""Backend "jax": ``jax.nn.dot_product_attention`` (XLA, or cuDNN on GPU), with flashcore's
semantics kept around it.

- Layout: JAX's own is ``(B, N, H, D)``, flashcore's ``"bnhd"``; ``"bhnd"`` is transposed
  (XLA fuses the transpose; JAX arrays have no strided views to read in place).
- Causal masking aligned to the bottom right: rows that see no key (the first ``Nq - Nk``
  when ``Nq > Nk``) are cut off before the call and given output 0 and lse ``-inf``; the
  remaining rows form a square lower triangle (JAX's ``is_causal``). With ``Nq < Nk`` an
  explicit bottom-right mask is passed (cuDNN declines masks, so JAX then uses XLA).
- GQA/MQA is native to ``jax.nn.dot_product_attention``.
- lse comes from ``return_residual=True`` (jax >= 0.6), which returns the log-sum-exp of
  the scaled scores, ``(B, Nq, Hq)``; lse is treated as a constant by autodiff.
- The backward pass is JAX's autodiff of the same computation (``jax.vjp``).
- float32 inputs are multiplied at float32 precision (``default_matmul_precision
  ("highest")``; XLA's default on GPUs is TF32, about 1e-3 relative error).
- float64 inputs do not go to ``jax.nn.dot_product_attention``: its XLA path casts the
  scores to float32 whatever the inputs (o and lse ~1e-7 off a float64 oracle). The same
  computation (it materializes the scores too) is written out in float64 instead, and lse
  is float64 (the contract for float64 inputs).

Everything here is JAX code: it runs eagerly, under ``jax.jit`` and under ``jax.vmap``, and
is differentiable as it is. JAX is imported inside functions only.
"""
from __future__ import annotations

import importlib.util

from flashcore import _rules
from flashcore._errors import BackendUnavailableError

NAME = "jax"


def unavailable_reason():
    if importlib.util.find_spec("jax") is None:
        return 'JAX is not installed; install it with pip install "flashcore[jax]"'
    return None


def _has_residual():
    import inspect

    import jax

    return "return_residual" in inspect.signature(jax.nn.dot_product_attention).parameters


def supports(case):
    if case.library != "jax":
        return f"it serves only JAX arrays; got {case.library} arrays"
    if case.packed:
        return ("varlen and KV-cache calls are not given to jax.nn.dot_product_attention; "
                "numba_cpu and reference serve them")
    if case.mods is not None:
        return (f"jax.nn.dot_product_attention is not given {', '.join(case.mods.names())} "
                "by flashcore; numba_cpu and reference compute them")
    if case.direction == "forward" and case.need_lse and not _has_residual():
        import jax

        return (f"jax {jax.__version__} has no return_residual in "
                "jax.nn.dot_product_attention, so it cannot return lse (jax >= 0.6 can)")
    return None


def _attend_float64(q, k, v, case):
    """(o, lse) as :func:`_attend`, in float64 throughout."""
    import jax
    import jax.numpy as jnp

    nq, nk = q.shape[1], k.shape[1]
    group = q.shape[2] // k.shape[2]  # query head h reads key/value head h // group
    k, v = (jnp.repeat(x, group, axis=2) if group > 1 else x for x in (k, v))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision="highest") * case.scale
    seen = _rules.visible(jnp, nq, nk, case.causal)
    if seen is not None:
        s = jnp.where(seen, s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)  # a NaN score makes its row NaN, as in the kernels
    o = jnp.einsum("bhqk,bkhd->bqhd", jnp.exp(s - lse[..., None]), v, precision="highest")
    return o, lse


def _attend(q, k, v, case, need_lse):
    """(o, lse or None) for bnhd q (B, n, Hq, D) whose rows each see at least one key."""
    import jax
    import jax.numpy as jnp

    if q.dtype == jnp.float64:
        o, lse = _attend_float64(q, k, v, case)
        return o, (jax.lax.stop_gradient(lse) if need_lse else None)
    nq, nk = q.shape[1], k.shape[1]
    kw = {"scale": case.scale}
    if case.causal and nq != nk:
        kw["mask"] = _rules.visible(jnp, nq, nk, True)[None, None]
    elif case.causal:
        kw["is_causal"] = True
    # float32 means float32 products: on GPUs XLA's default would round them to TF32.
    precision = "highest" if q.dtype in (jnp.float32, jnp.float64) else None
    with jax.default_matmul_precision(precision):
        if need_lse:
            o, lse = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
            lse = jnp.transpose(lse, (0, 2, 1)).astype(_rules.lse_dtype(case.dtype))
            lse = jax.lax.stop_gradient(lse)
            return o, lse
        return jax.nn.dot_product_attention(q, k, v, **kw), None


def forward(q, k, v, case):
    """``(o, lse)``; lse is None unless ``case.need_lse``."""
    import jax.numpy as jnp

    if case.need_lse:
        why = supports(case)
        if why is not None:
            raise BackendUnavailableError(f"backend 'jax' cannot return lse here: {why}")
    to_bnhd = (lambda x: x) if case.layout == "bnhd" else (lambda x: jnp.swapaxes(x, 1, 2))
    qb, kb, vb = (to_bnhd(x) for x in (q, k, v))
    B, Hq, Nq, D = case.batch, case.heads_q, case.seqlen_q, case.head_dim
    skip = _rules.leading_empty_rows(Nq, case.seqlen_k, case.causal)
    if skip == Nq or B == 0:
        o = jnp.zeros((B, Nq, Hq, D), dtype=q.dtype)
        lse = (jnp.full((B, Hq, Nq), _rules.EMPTY_ROW_LSE, dtype=_rules.lse_dtype(case.dtype))
               if case.need_lse else None)
    else:
        o, lse = _attend(qb[:, skip:], kb, vb, case, case.need_lse)
        if skip:
            o = jnp.concatenate([jnp.zeros((B, skip, Hq, D), dtype=o.dtype), o], axis=1)
            if lse is not None:
                lse = jnp.concatenate(
                    [jnp.full((B, Hq, skip), _rules.EMPTY_ROW_LSE, dtype=lse.dtype), lse],
                    axis=2)
    return to_bnhd(o), lse


def backward(do, q, k, v, o, lse, case):
    """Gradients by JAX's autodiff of :func:`forward` (``o`` and ``lse`` are not needed)."""
    from dataclasses import replace

    import jax

    fcase = replace(case, direction="forward", need_lse=False)
    _, pull = jax.vjp(lambda a, b, c: forward(a, b, c, fcase)[0], q, k, v)
    return tuple(pull(do))
