"""What every contender is: :class:`Contender`, one way to compute attention, made ready for
a config by ``prepare``; and the checks of whether it can run here."""
from __future__ import annotations

from .config import DIRECTIONS, Config, host_inputs
from .libraries import gpu_free_bytes, library_reason
from .machine import available_host_memory
from .measure import Prepared, first_line

#: A contender that materializes the score matrix is skipped when its estimated extra memory
#: exceeds this fraction of the memory available on its device.
MEMORY_GUARD = 0.5


class Contender:
    """One way to compute attention. Subclasses set the fields and implement ``_prepare``."""

    name = ""
    kind = "peer"  # "flashcore" or "peer"
    library = "numpy"
    device = "cpu"
    materializes = False  # builds the Nq × Nk score matrix
    description = ""

    def unavailable_reason(self, config: Config | None = None) -> str | None:
        """None if this contender can run ``config`` here, else why not."""
        why = library_reason(self.library, self.device)
        if why is None and config is not None:
            why = self.mask_reason(config)
        if why is None and config is not None and self.materializes:
            why = memory_guard(self, config)
        return why

    def prepare(self, config: Config, direction: str, seed: int = 0, host=None) -> Prepared:
        """Make inputs (``host``: the arrays of :func:`host_inputs`, if already made) and
        return the ready-to-run call."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction={direction!r} is not one of {DIRECTIONS}")
        if host is None:
            host = host_inputs(config, seed)
        prep = self._prepare(config, direction, host)
        prep.device = self.device
        return prep

    def _prepare(self, config, direction, host) -> Prepared:
        raise NotImplementedError

    def estimated_extra_bytes(self, config: Config, direction: str = "fwdbwd") -> float:
        """Rough extra memory of a materializing run (score-sized temporaries)."""
        s = config.scores() * max(config.itemsize, 4)
        return (3 if direction == "fwd" else 6) * s

    def mask_reason(self, config: Config) -> str | None:
        """None if this contender can be given ``config.mask``, else why not (a contender
        that knows no masks says so for every mask but ``none``)."""
        if config.mask == "none":
            return None
        return f"the bench gives {self.name} no masks (mask {config.mask})"

    def mask_how(self, config: Config) -> str:
        """How this contender is given ``config.mask`` (for the report)."""
        return ""

    def info(self) -> dict:
        return {"name": self.name, "kind": self.kind, "library": self.library,
                "device": self.device, "materializes": self.materializes,
                "description": self.description}

    def __repr__(self):
        return f"<contender {self.name}>"


def memory_guard(contender: Contender, config: Config) -> str | None:
    """Why ``contender`` would not fit in the memory free on its device, or None."""
    need = contender.estimated_extra_bytes(config)
    if contender.device == "cpu":
        have = available_host_memory()
    else:
        have = gpu_free_bytes(contender.device)
    if have is not None and need > MEMORY_GUARD * have:
        return (f"it materializes the {config.seqlen}x{config.seqlen} score matrices "
                f"(about {need / 2**30:.1f} GiB) and {have / 2**30:.1f} GiB are free")
    return None


def backend_reason(name: str) -> str | None:
    """``flashcore._dispatch.unavailable_reason(name)``, with a backend that fails to answer
    (a module still being written, a broken install) reported as a reason, not raised."""
    from flashcore import _dispatch

    try:
        return _dispatch.unavailable_reason(name)
    except Exception as e:  # the backend does not answer its contract: it cannot run here
        return f"backend {name!r} does not answer (it raised {first_line(e)})"
