"""The naive peer: softmax(Q Kᵀ · scale) V written plainly with a library's own array
functions, materializing the ``Nq × Nk`` scores: what flashcore is measured against for
speed and memory."""
from __future__ import annotations

import math

import numpy as np

from .config import to_library
from .contender import Contender
from .libraries import array_device, gpu_memory_for, sync_for, timer_for
from .measure import Prepared


class Naive(Contender):
    """softmax(Q Kᵀ · scale) V written plainly with the library's own array functions
    (Array API), materializing the scores; fwd+bwd adds the textbook backward. float16 and
    bfloat16 inputs are computed in float32 (NumPy has no fast half-precision matmul)."""

    materializes = True

    def __init__(self, library: str = "numpy", device: str = "cpu"):
        self.library, self.device = library, device
        self.name = f"{library}_naive" + ("" if device == "cpu" else "@gpu")
        self.description = f"naive softmax(QK^T)V in {library} ({device})"

    def _prepare(self, config, direction, host):
        if self.library == "numpy" and config.dtype in ("float16", "bfloat16"):
            host = tuple(a.astype(np.float32) for a in host)
        q, k, v, do = (to_library(a, self.library, self.device) for a in host)
        import array_api_compat

        xp = array_api_compat.array_namespace(q)
        scale, causal = config.scale, config.causal
        if direction == "fwd":
            def call():
                return naive_forward(xp, q, k, v, scale, causal)[0]
        else:
            def call():
                o, p = naive_forward(xp, q, k, v, scale, causal)
                return naive_backward(xp, do, q, k, v, o, p, scale)
        return Prepared(call, sync_for(self.library, self.device),
                        timer_for(self.library, self.device),
                        gpu_memory_for(self.library, self.device))


def naive_forward(xp, q, k, v, scale, causal):
    """``(o, p)``: output and probabilities of softmax(q kᵀ · scale) v, with flashcore's
    mask rule (``flashcore._rules.visible``: bottom-right causal).

    Written as a careful user would: augmented assignments, which update NumPy, PyTorch and
    CuPy arrays in place (and rebind JAX's), so only the score matrix itself is allocated."""
    from flashcore import _rules

    s = xp.matmul(q * scale, xp.matrix_transpose(k))
    visible = _rules.visible(xp, q.shape[-2], k.shape[-2], causal, array_device(q))
    if visible is not None:
        s = _fill_where(xp, s, xp.logical_not(visible), -math.inf)
    s -= xp.max(s, axis=-1, keepdims=True)
    p = _exp_inplace(xp, s)
    p /= xp.sum(p, axis=-1, keepdims=True)
    return xp.matmul(p, v), p


def naive_backward(xp, do, q, k, v, o, p, scale):
    """``(dq, dk, dv)`` from the saved probabilities ``p``."""
    t = xp.matrix_transpose
    dv = xp.matmul(t(p), do)
    ds = xp.matmul(do, t(v))  # dP, turned into dS = P * (dP - rowsum(dO * O)) in place
    ds -= xp.sum(do * o, axis=-1, keepdims=True)
    ds *= p
    dq = xp.matmul(ds, k * scale)
    dk = xp.matmul(t(ds), q * scale)
    return dq, dk, dv


def _exp_inplace(xp, s):
    if isinstance(s, np.ndarray):
        return np.exp(s, out=s)
    if hasattr(s, "exp_"):  # torch
        return s.exp_()
    return xp.exp(s)


def _fill_where(xp, s, mask, value):
    """``s`` with ``value`` where ``mask`` (broadcast) is true; in place where the library can."""
    if isinstance(s, np.ndarray):
        np.copyto(s, value, where=np.broadcast_to(mask, s.shape))
        return s
    if hasattr(s, "masked_fill_"):  # torch
        return s.masked_fill_(mask, value)
    return xp.where(mask, xp.asarray(value, dtype=s.dtype, device=array_device(s)), s)
