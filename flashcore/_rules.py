"""The attention rules every backend, the reference and the tests share, written once.

Which key a query row sees (the mask rule) and what a row that sees no key returns are
stated here; kernels apply the same rules through their own seams (``backends/*/seams``),
and everything array-valued here is built with the caller's Array API namespace ``xp``.
"""
from __future__ import annotations

import math

#: What a row that sees no key returns: output 0, logsumexp -inf, zero gradients.
EMPTY_ROW_LSE = -math.inf


def lse_dtype(dtype: str) -> str:
    """The dtype of lse for inputs of ``dtype``: float64 for float64 (the backward's
    ``P = exp(S - lse)`` would otherwise inherit float32 rounding, and float64 gradients
    would be float32-accurate), float32 for float16, bfloat16 and float32."""
    return "float64" if dtype == "float64" else "float32"


def causal_offset(seqlen_q: int, seqlen_k: int) -> int:
    """Bottom-right alignment: query ``i`` sees key ``j`` iff ``j <= i + causal_offset``."""
    return seqlen_k - seqlen_q


def visible(xp, seqlen_q: int, seqlen_k: int, causal: bool, device=None):
    """Boolean ``(seqlen_q, seqlen_k)`` array: True where query ``i`` sees key ``j``, or
    None when every query sees every key (so callers can skip the mask)."""
    if not causal:
        return None
    at = _on(device)
    i = xp.reshape(xp.arange(seqlen_q, **at), (seqlen_q, 1))
    j = xp.reshape(xp.arange(seqlen_k, **at), (1, seqlen_k))
    return j <= i + causal_offset(seqlen_q, seqlen_k)


def additive_mask(xp, seqlen_q: int, seqlen_k: int, causal: bool, dtype, device=None):
    """The same rule as a score bias of ``dtype``: 0 where query ``i`` sees key ``j``,
    ``-inf`` where it does not, ``(seqlen_q, seqlen_k)``; None when every query sees every
    key. For kernels that take the mask as an addend (torch's CPU flash kernel)."""
    seen = visible(xp, seqlen_q, seqlen_k, causal, device)
    if seen is None:
        return None
    zero = xp.zeros((seqlen_q, seqlen_k), dtype=dtype, **_on(device))
    return xp.where(seen, zero, xp.full_like(zero, -math.inf))


def _on(device) -> dict:
    # device=None is left out: NumPy before 2.0 has no device argument.
    return {} if device is None else {"device": device}


def leading_empty_rows(seqlen_q: int, seqlen_k: int, causal: bool) -> int:
    """How many leading query rows see no key (all when there is no key; with ``causal``,
    the first ``Nq - Nk``)."""
    if seqlen_k == 0:
        return seqlen_q
    if causal:
        return max(0, seqlen_q - seqlen_k)
    return 0
