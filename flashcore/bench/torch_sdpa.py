"""The PyTorch peer: ``torch.nn.functional.scaled_dot_product_attention``, by default or
pinned to one of its kernels."""
from __future__ import annotations

import contextlib

from .config import to_library
from .contender import Contender
from .libraries import gpu_memory_for, import_torch, sync_for, timer_for
from .measure import Prepared

#: torch.nn.attention.SDPBackend member per peer name suffix
SDPA_KERNELS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION",
                "efficient": "EFFICIENT_ATTENTION", "math": "MATH"}


class TorchSdpa(Contender):
    """``torch.nn.functional.scaled_dot_product_attention``; ``kernel`` pins one of its
    backends through ``torch.nn.attention.sdpa_kernel`` (None lets PyTorch choose)."""

    library = "torch"

    def __init__(self, kernel: str | None = None, device: str = "cpu"):
        self.kernel, self.device = kernel, device
        self.name = "torch_sdpa" + (f"_{kernel}" if kernel else "") + (
            "" if device == "cpu" else "@gpu")
        self.materializes = kernel == "math"
        self.description = (f"torch SDPA ({kernel or 'default choice'}) on {device}")

    def _prepare(self, config, direction, host):
        torch = import_torch()
        sdpa = torch.nn.functional.scaled_dot_product_attention
        q, k, v, do = (to_library(a, "torch", self.device) for a in host)
        causal = config.causal
        if self.kernel:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            ctx = lambda: sdpa_kernel(getattr(SDPBackend, SDPA_KERNELS[self.kernel]))  # noqa: E731
        else:
            ctx = contextlib.nullcontext
        if direction == "fwd":
            def call():
                with torch.no_grad(), ctx():
                    return sdpa(q, k, v, is_causal=causal)
        else:
            qg, kg, vg = (x.detach().requires_grad_(True) for x in (q, k, v))

            def call():
                with ctx():
                    o = sdpa(qg, kg, vg, is_causal=causal)
                    return torch.autograd.grad(o, (qg, kg, vg), do)
        return Prepared(call, sync_for("torch", self.device), timer_for("torch", self.device),
                        gpu_memory_for("torch", self.device))
