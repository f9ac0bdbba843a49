"""The description of one attention call that every backend is asked about.

The front end builds a :class:`Case` after checking the arguments; backends answer
``supports(case)`` from it and read sizes and options from it when they launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import _rules

#: dtypes flashcore computes on, by name.
DTYPES = ("float16", "bfloat16", "float32", "float64")
LAYOUTS = ("bhnd", "bnhd")


@dataclass(frozen=True)
class Case:
    """Sizes, dtype, options and origin of one call (hashable, so it can key caches).

    Shapes follow the layout: ``"bhnd"`` is q ``(B, Hq, Nq, D)`` and k, v
    ``(B, Hkv, Nk, D)``; ``"bnhd"`` is q ``(B, Nq, Hq, D)`` and k, v ``(B, Nk, Hkv, D)``.
    """

    library: str  # "numpy", "torch", "jax", "cupy", or another Array API namespace's name
    device: str  # "cpu" or "cuda:N"
    dtype: str  # one of DTYPES
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    scale: float
    layout: str
    direction: str = "forward"  # "forward" or "backward"
    need_lse: bool = False  # forward only: whether the caller wants lse back
    explicit: bool = False  # the caller named the backend (so it may copy host<->device, or be slow)
    mods: object = None  # flashcore._mods.Mods: masks and score modifiers (None: plain)
    # The arrays the mods read, this call's own (not part of the case's identity).
    alibi_slopes: object = field(default=None, compare=False, hash=False, repr=False)
    mod_args: tuple = field(default=(), compare=False, hash=False, repr=False)

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.heads_q // self.heads_kv

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def causal_offset(self) -> int:
        """Bottom-right alignment: query ``i`` sees key ``j`` iff ``j <= i + causal_offset``."""
        return _rules.causal_offset(self.seqlen_q, self.seqlen_k)

    def flops(self) -> float:
        """Floating-point operations of the forward pass (two matmuls), halved when causal."""
        f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return f / 2 if self.causal else f
