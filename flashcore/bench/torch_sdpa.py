"""The PyTorch peer: ``torch.nn.functional.scaled_dot_product_attention``, by default or
pinned to one of its kernels."""
from __future__ import annotations

import contextlib

from . import masks
from .config import to_library
from .contender import Contender
from .libraries import gpu_memory_for, import_torch, sync_for, timer_for
from .measure import Prepared

#: torch.nn.attention.SDPBackend member per peer name suffix
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


class TorchSdpa(Contender):
    """``torch.nn.functional.scaled_dot_product_attention``; ``kernel`` pins one of its
    backends through ``torch.nn.attention.sdpa_kernel`` (None lets PyTorch choose).

    A masked config is given as SDPA's ``attn_mask`` (made in ``prepare``, untimed): boolean
    for ``window`` and ``docs``, a float additive bias for ``alibi`` and ``relpos``, with
    ``causal`` folded in; SDPA cannot express a softcap, so softcap cases are skipped."""

    library = "torch"

    def __init__(self, kernel: str | None = None, device: str = "cpu"):
        self.kernel, self.device = kernel, device
        self.name = "torch_sdpa" + (f"_{kernel}" if kernel else "") + (
            "" if device == "cpu" else "@gpu")
        self.materializes = kernel == "math"
        self.description = (f"torch SDPA ({kernel or 'default choice'}) on {device}")

    def mask_reason(self, config):
        if masks.parse_mask(config.mask).kind in ("softcap", "softcap-py"):
            return "torch SDPA has no softcap (tanh of the scores) and takes no score_mod"
        return None

    def mask_how(self, config):
        return masks.dense_how(config)

    def _prepare(self, config, direction, host):
        torch = import_torch()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q, k, v, do = (to_library(a, "torch", self.device) for a in host)
        causal, mask = config.causal, None
        vis, bias = masks.dense_visible(config), masks.dense_bias(config)
        if vis is not None:
            mask = torch.from_numpy(vis).to(self.device)
        elif bias is not None:
            mask = torch.from_numpy(bias).to(device=self.device, dtype=q.dtype)
        if mask is not None:
            causal = False  # folded into the mask (SDPA takes one or the other)
        kw = dict(is_causal=causal, attn_mask=mask)
        if self.kernel:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = lambda: sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[self.kernel]))  # noqa: E731
        else:
            ctx = contextlib.nullcontext
        if direction == "fwd":
            def call():
                with torch.no_grad(), ctx():
                    return sdpa(q, k, v, **kw)
        else:
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def call():
                with ctx():
                    o = sdpa(qg, kg, vg, **kw)
                    return torch.autograd.grad(o, (qg, kg, vg), do)
        return Prepared(call, sync_for("torch", self.device), timer_for("torch", self.device),
                        gpu_memory_for("torch", self.device))
