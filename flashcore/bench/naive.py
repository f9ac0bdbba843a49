"""The naive peer: softmax(Q Kᵀ · scale) V written plainly with a library's own array
functions, materializing the ``Nq × Nk`` scores: what flashcore is measured against for
speed and memory."""
from __future__ import annotations

import math

import numpy as np

from . import masks
from .config import to_library
from .contender import Contender
from .libraries import array_device, gpu_memory_for, sync_for, timer_for
from .measure import Prepared


class Naive(Contender):
    """softmax(Q Kᵀ · scale) V written plainly with the library's own array functions
    (Array API), materializing the scores; fwd+bwd adds the textbook backward. float16 and
    bfloat16 inputs are computed in float32 (NumPy has no fast half-precision matmul).
    Masked configs apply the boolean mask or additive bias of :mod:`flashcore.bench.masks` to
    the score matrix (made in ``prepare``, untimed); softcap forward only (the textbook
    backward has no softcap chain factor, so softcap fwd+bwd is skipped)."""

    materializes = True

    def __init__(self, library: str = "numpy", device: str = "cpu"):
        self.library, self.device = library, device
        self.name = f"{library}_naive" + ("" if device == "cpu" else "@gpu")
        self.description = f"naive softmax(QK^T)V in {library} ({device})"

    def mask_reason(self, config):
        return None

    def mask_how(self, config):
        return masks.dense_how(config, "score matrix")

    def _prepare(self, config, direction, host):
        if self.library == "numpy" and config.dtype in ("float16", "bfloat16"):
            host = tuple(a.astype(np.float32) for a in host)
        q, k, v, do = (to_library(a, self.library, self.device) for a in host)
        import array_api_compat

        xp = array_api_compat.array_namespace(q)
        scale, causal = config.scale, config.causal
        m = masks.parse_mask(config.mask)
        kw = {}
        if m.kind in ("softcap", "softcap-py"):
            kw["softcap"] = float(m.value)
        vis, bias = masks.dense_visible(config), masks.dense_bias(config)
        if vis is not None:
            kw["visible"] = to_library(vis, self.library, self.device)
        if bias is not None:
            kw["bias"] = to_library(bias, self.library, self.device)
        if direction == "fwd":
            def call():
                return naive_forward(xp, q, k, v, scale, causal, **kw)[0]
        elif "softcap" in kw:
            def call():  # declines on the first, untimed call: reported as the skip
                raise NotImplementedError(
                    "the naive backward has no softcap chain factor (forward only)")
        else:
            def call():
                o, p = naive_forward(xp, q, k, v, scale, causal, **kw)
                return naive_backward(xp, do, q, k, v, o, p, scale)
        return Prepared(call, sync_for(self.library, self.device),
                        timer_for(self.library, self.device),
                        gpu_memory_for(self.library, self.device))


def naive_forward(xp, q, k, v, scale, causal, *, visible=None, bias=None, softcap=None):
    """``(o, p)``: output and probabilities of softmax(q kᵀ · scale) v, with flashcore's
    mask rule (``flashcore._rules.visible``: bottom-right causal).

    ``softcap``: ``s = softcap * tanh(s / softcap)``; ``bias``: added to the scores (causal
    already folded in as ``-inf``); ``visible``: a boolean mask that replaces the causal
    rule (causal already folded in). Every row must see at least one key.

    Written as a careful user would: augmented assignments, which update NumPy, PyTorch and
    CuPy arrays in place (and rebind JAX's), so only the score matrix itself is allocated."""
    from flashcore import _rules

    s = xp.matmul(q * scale, xp.matrix_transpose(k))
    if softcap is not None:
        s = xp.tanh(s / softcap)
        s *= softcap
    if bias is not None:
        s += bias
    elif visible is None:
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
