"""Which contenders exist, by name, and which a default sweep runs."""
from __future__ import annotations

from .contender import Contender
from .flashcore_api import FlashcoreContender
from .jax_dpa import JaxDpa
from .libraries import gpu_library
from .naive import Naive
from .torch_flex import TorchFlex
from .torch_sdpa import TorchSdpa

#: Contenders left out of a default sweep (slow or redundant); name them to include them.
NOT_BY_DEFAULT = {"flashcore:reference", "torch_sdpa_math", "flashcore:jax", "flashcore:torch",
                  "torch_flex@gpu"}
#: Contenders a default sweep adds when it has masked configs (the peers made for masks).
WITH_MASKS = {"torch_flex@gpu"}


def contenders(device: str = "auto") -> list[Contender]:
    """Every contender this runner knows, for ``device`` ("cpu", "cuda", or "auto": the GPU
    contenders where a GPU is visible, else the CPU ones). Availability is not checked here."""
    if device == "auto":
        device = "cuda" if gpu_library() is not None else "cpu"
    if device == "cpu":
        return [
            FlashcoreContender("numba_cpu", "numpy"),
            FlashcoreContender("torch", "torch"),
            FlashcoreContender("jax", "jax"),
            FlashcoreContender("reference", "numpy"),
            TorchSdpa(None), TorchSdpa("math"),
            JaxDpa("xla"),
            Naive("numpy"),
        ]
    if device == "cuda":
        dev = "cuda:0"
        lib = gpu_library() or "torch"
        return [
            FlashcoreContender("numba_cuda", lib, dev),
            FlashcoreContender("torch", "torch", dev),
            FlashcoreContender("jax", "jax", dev),
            TorchSdpa("flash", dev), TorchSdpa("cudnn", dev), TorchSdpa("efficient", dev),
            TorchSdpa("math", dev),
            JaxDpa("cudnn", dev), JaxDpa("xla", dev),
            TorchFlex(dev),
            Naive("torch", dev),
        ]
    raise ValueError(f"device={device!r} is not one of ('auto', 'cpu', 'cuda')")


def all_contenders() -> list[Contender]:
    """The CPU contenders, then the GPU ones (names ending in ``@gpu``)."""
    return contenders("cpu") + contenders("cuda")


def get_contender(name: str) -> Contender:
    """The contender called ``name`` (CPU names, or GPU names with the ``@gpu`` suffix)."""
    for c in all_contenders():
        if c.name == name:
            return c
    raise ValueError(f"contender {name!r} is not one of {contender_names()}")


def contender_names() -> list[str]:
    return [c.name for c in all_contenders()]


def default_contenders(device: str = "auto", masked: bool = False) -> list[Contender]:
    """The contenders a default sweep runs: those available here, minus NOT_BY_DEFAULT (but
    WITH_MASKS when the sweep has ``masked`` configs); the flashcore reference joins only
    when flashcore has no kernel backend here."""
    cands = [c for c in contenders(device) if c.unavailable_reason() is None]
    own = [c for c in cands if c.kind == "flashcore" and c.backend not in ("reference",)]
    chosen = [c for c in cands if c.name not in NOT_BY_DEFAULT
              or (masked and c.name in WITH_MASKS)]
    if not own:
        chosen = [c for c in cands if c.name == "flashcore:reference"] + chosen
    return chosen
