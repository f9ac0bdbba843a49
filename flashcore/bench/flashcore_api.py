"""flashcore's own backends as contenders, called through the public API."""
from __future__ import annotations

from . import masks
from .config import to_library
from .contender import Contender, backend_reason, memory_guard
from .libraries import gpu_memory_for, library_reason, sync_for, timer_for
from .measure import Prepared


class FlashcoreContender(Contender):
    """A flashcore backend called through the public API (``attention_forward`` and, for
    fwd+bwd, ``attention_backward``) on arrays of the library that backend serves. A masked
    config passes the options of :func:`flashcore.bench.masks.flashcore_options` (a
    ``docs`` BlockMask is made in ``prepare``, untimed); a backend that does not serve them
    declines on the first (untimed) call, and the bench reports its reason as the skip."""

    kind = "flashcore"

    def __init__(self, backend: str, library: str, device: str = "cpu"):
        self.backend, self.library, self.device = backend, library, device
        self.name = f"flashcore:{backend}" + ("" if device == "cpu" else "@gpu")
        self.materializes = backend == "reference"
        self.description = f"flashcore backend {backend!r} on {library} arrays ({device})"

    def unavailable_reason(self, config=None):
        why = library_reason(self.library, self.device)
        if why is not None:
            return why
        why = backend_reason(self.backend)
        if why is not None:
            return why
        if config is not None and self.materializes:
            return memory_guard(self, config)
        return None

    def mask_reason(self, config):
        return None  # the backend itself says whether it serves the options

    def mask_how(self, config):
        return masks.flashcore_how(config)

    def estimated_extra_bytes(self, config, direction="fwdbwd"):
        s = config.scores() * 8  # the reference computes in float64
        return (3 if direction == "fwd" else 6) * s

    def _prepare(self, config, direction, host):
        import flashcore

        q, k, v, do = (to_library(a, self.library, self.device) for a in host)
        opts = dict(causal=config.causal, backend=self.backend,
                    **masks.flashcore_options(
                        config, lambda a: to_library(a, self.library, self.device)))
        if direction == "fwd":
            def call():
                return flashcore.attention_forward(q, k, v, **opts)
        else:
            def call():
                o, lse = flashcore.attention_forward(q, k, v, **opts)
                return flashcore.attention_backward(do, q, k, v, o, lse, **opts)
        return Prepared(call, sync_for(self.library, self.device),
                        timer_for(self.library, self.device),
                        gpu_memory_for(self.library, self.device))
