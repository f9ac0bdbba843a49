"""Problem sizes (:class:`Config`) and the seeded inputs every contender is measured on."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .libraries import LIBRARIES, import_jax, import_torch
from .masks import canonical, visible_fraction

DIRECTIONS = ("fwd", "fwdbwd")
DIRECTION_LABEL = {"fwd": "forward", "fwdbwd": "forward+backward"}
DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class Config:
    """One problem size: q, k, v of shape ``(batch, heads, seqlen, head_dim)`` ("bhnd"), and
    the mask (``"none"``, ``"window:512"``, ``"docs:8"``, ...: see :mod:`.masks`)."""

    batch: int = 1
    heads: int = 8
    seqlen: int = 4096
    head_dim: int = 64
    dtype: str = "float32"
    causal: bool = False
    mask: str = "none"

    def __post_init__(self):
        for name in ("batch", "heads", "seqlen", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer; got {name}={value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        object.__setattr__(self, "mask", canonical(self.mask))  # ValueError if unknown

    @property
    def shape(self):
        return (self.batch, self.heads, self.seqlen, self.head_dim)

    @property
    def itemsize(self) -> int:
        return {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}[self.dtype]

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def visible_fraction(self) -> float:
        """The fraction of the N² scores the FLOP and byte models count: 1, or 1/2 when
        causal, without a sparse mask (score modifiers such as softcap, alibi, relpos change
        no count); for ``window:W`` and ``docs:K`` the exact fraction of visible (query, key)
        pairs (about W/N and 1/K), so FLOP/s of a masked case compare with an unmasked one."""
        return visible_fraction(self.mask, self.seqlen, self.causal)

    def flops(self, direction: str) -> float:
        """Nominal FLOPs: forward 4·B·H·N²·D, backward 2.5× forward, times the visible
        fraction (halved when causal; about W/N for ``window:W``, 1/K for ``docs:K``)."""
        f = 4.0 * self.batch * self.heads * self.seqlen * self.seqlen * self.head_dim
        f *= self.visible_fraction()
        return f if direction == "fwd" else 3.5 * f

    def scores(self) -> int:
        """Elements of the score matrix, ``B·H·N²``."""
        return self.batch * self.heads * self.seqlen * self.seqlen

    def io_bytes(self, direction: str, materializes: bool = False) -> float:
        """Modelled memory traffic (see :mod:`flashcore.bench`); the score-matrix traffic of a
        materializing contender is counted over the visible fraction, like the FLOPs."""
        x = self.batch * self.heads * self.seqlen * self.head_dim * self.itemsize  # one tensor
        lse = 4 * self.batch * self.heads * self.seqlen
        fwd = 4 * x + lse  # read q, k, v; write o and lse
        # backward: read q, k, v, o, do, lse; write dq, dk, dv
        total = fwd if direction == "fwd" else fwd + 8 * x + lse
        if materializes:
            s = self.scores() * max(self.itemsize, 4) * self.visible_fraction()
            # forward: write S, read S, write P, read P;
            # backward: read P, write and read dP, write and read dS
            total += 4 * s if direction == "fwd" else 9 * s
        return float(total)

    def label(self) -> str:
        c = "causal" if self.causal else "non-causal"
        m = "" if self.mask == "none" else f" {self.mask}"
        return (f"B={self.batch} H={self.heads} N={self.seqlen} D={self.head_dim} "
                f"{self.dtype} {c}{m}")

    def as_dict(self) -> dict:
        """The fields; ``mask`` only when there is one (a bench without masks writes the
        JSON it always wrote)."""
        d = dataclasses.asdict(self)
        if self.mask == "none":
            del d["mask"]
        return d


def host_inputs(config: Config, seed: int = 0, with_grad: bool = True):
    """Seeded standard-normal ``q, k, v`` (and ``do``) as NumPy arrays in ``config.dtype``,
    shape ``(B, H, N, D)``; bfloat16 as ``ml_dtypes.bfloat16``."""
    rng = np.random.default_rng(seed)
    dt = np.dtype(config.dtype) if config.dtype != "bfloat16" else _bf16()
    n = 4 if with_grad else 3
    return tuple(rng.standard_normal(config.shape, dtype=np.float32).astype(dt, copy=False)
                 for _ in range(n))


def _bf16():
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


def to_library(a: np.ndarray, library: str, device: str = "cpu", layout: str = "bhnd"):
    """Hand a host array (given in bhnd) to ``library`` on ``device``, in ``layout``."""
    if layout == "bnhd":
        a = np.ascontiguousarray(np.swapaxes(a, 1, 2))
    if library == "numpy":
        return a
    if library == "torch":
        torch = import_torch()
        if a.dtype.name == "bfloat16":  # torch.from_numpy knows no ml_dtypes type
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(a)
        return t.to(device) if device != "cpu" else t
    if library == "jax":
        jax = import_jax()
        plat = "gpu" if device.startswith("cuda") else "cpu"
        idx = int(device.split(":")[1]) if ":" in device else 0
        return jax.device_put(a, jax.devices(plat)[idx])
    if library == "cupy":
        import cupy

        with cupy.cuda.Device(int(device.split(":")[1]) if ":" in device else 0):
            return cupy.asarray(a)
    raise ValueError(f"{library=} is not one of {LIBRARIES}")
