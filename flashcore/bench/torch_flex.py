"""The FlexAttention peer: ``torch.nn.attention.flex_attention.flex_attention`` under
``torch.compile``, given each mask as FlexAttention's own ``score_mod`` / ``block_mask``."""
from __future__ import annotations

import math

from . import masks
from .config import to_library
from .contender import Contender
from .libraries import gpu_memory_for, import_torch, sync_for, timer_for
from .measure import Prepared

_COMPILED = {}


def flex_reason() -> str | None:
    """None if this PyTorch has FlexAttention, else why not."""
    try:
        from torch.nn.attention import flex_attention  # noqa: F401
    except ImportError as e:
        return f"this PyTorch has no torch.nn.attention.flex_attention ({e})"
    return None


def flex_mods(config, device: str = "cpu"):
    """``(score_mod, mask_mod)`` of FlexAttention for ``config`` (either may be None): the
    same rule as flashcore's options (:func:`flashcore.bench.masks.flashcore_options`),
    written on FlexAttention's index tensors, with ``causal`` in the mask_mod."""
    torch = import_torch()
    m = masks.parse_mask(config.mask)
    causal = config.causal
    score_mod = None
    mask_mod = None
    if m.kind in ("softcap", "softcap-py"):
        cap = float(m.value)

        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
    elif m.kind == "alibi":
        slopes = torch.from_numpy(masks.alibi_slopes(config.heads)).to(device)

        def score_mod(score, b, h, q_idx, kv_idx):
            return score - (slopes[h] * (q_idx - kv_idx).abs()).to(score.dtype)
    elif m.kind == "relpos":
        slope = masks.RELPOS_SLOPE

        def score_mod(score, b, h, q_idx, kv_idx):
            return score + slope * (kv_idx - q_idx).to(score.dtype)
    if m.kind == "window":
        left, right = m.window()
        right = 0 if causal else right

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx >= q_idx - left) & (kv_idx <= q_idx + right)
    elif m.kind == "docs":
        doc = torch.from_numpy(masks.doc_ids(config.batch, config.seqlen,
                                             int(m.value))).to(device)
        if causal:
            def mask_mod(b, h, q_idx, kv_idx):
                return (doc[b, q_idx] == doc[b, kv_idx]) & (kv_idx <= q_idx)
        else:
            def mask_mod(b, h, q_idx, kv_idx):
                return doc[b, q_idx] == doc[b, kv_idx]
    elif causal:
        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx
    return score_mod, mask_mod


class TorchFlex(Contender):
    """FlexAttention under ``torch.compile`` (``compiled=False``: eager, PyTorch's slow
    reference path, for checks only). Its BlockMask comes from FlexAttention's own
    ``create_block_mask``, made in ``prepare`` (untimed); the warm-up call compiles."""

    library = "torch"

    def __init__(self, device: str = "cuda:0", compiled: bool = True):
        self.device, self.compiled = device, compiled
        self.name = "torch_flex" + ("" if device == "cpu" else "@gpu")
        self.description = f"torch FlexAttention (torch.compile) on {device}"

    def unavailable_reason(self, config=None):
        if self.device == "cpu" and self.compiled:
            return "the bench runs FlexAttention on CUDA only"
        why = super().unavailable_reason(config)
        return why if why is not None else flex_reason()

    def mask_reason(self, config):
        return None

    def mask_how(self, config):
        return "FlexAttention score_mod / mask_mod, its block_mask made untimed"

    def _prepare(self, config, direction, host):
        torch = import_torch()
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        q, k, v, do = (to_library(a, "torch", self.device) for a in host)
        score_mod, mask_mod = flex_mods(config, self.device)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, config.batch, None, config.seqlen,
                                           config.seqlen, device=self.device)
        flex = flex_attention
        if self.compiled:
            if "flex" not in _COMPILED:
                _COMPILED["flex"] = torch.compile(flex_attention, dynamic=False)
            flex = _COMPILED["flex"]
        kw = dict(score_mod=score_mod, block_mask=block_mask,
                  scale=1.0 / math.sqrt(config.head_dim))
        if direction == "fwd":
            def call():
                with torch.no_grad():
                    return flex(q, k, v, **kw)
        else:
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def call():
                o = flex(qg, kg, vg, **kw)
                return torch.autograd.grad(o, (qg, kg, vg), do)
        return Prepared(call, sync_for("torch", self.device), timer_for("torch", self.device),
                        gpu_memory_for("torch", self.device))
