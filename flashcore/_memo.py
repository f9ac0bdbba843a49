"""The bounded memo every front-end cache uses: get, else build and keep; emptied when full.

The front end caches what it derives from the kind of a call (its checked
:class:`~flashcore._case.Case`, the backends chosen for it), because on small inputs the
checks and the selection cost more host time than the kernel launch. Each caller keys its
memo with what its own checks read; a key of None (an argument that cannot key a dict)
builds every time and keeps nothing. A full memo is emptied rather than trimmed: kinds of
calls are few in practice, so this only bounds memory against a stream of new shapes.

:func:`clear_all` empties every memo (the tests call it around each test that changes a
backend's answers).
"""
from __future__ import annotations

#: Every memo made (they live as long as their modules), for :func:`clear_all`.
_ALL: list = []


class Memo(dict):
    """A dict of at most ``max_size`` entries, filled through :meth:`get_or_build`."""

    def __init__(self, max_size: int, *, plans: bool = True):
        """``plans=False``: a cache of compiled code (a kernel per user function), which
        :func:`clear_all` leaves alone (recompiling is slow, and what it keeps never
        depends on a backend's answers)."""
        super().__init__()
        self.max_size = max_size
        if plans:
            _ALL.append(self)

    def get_or_build(self, key, build, *args):
        """The value kept for ``key``, else ``build(*args)`` (kept unless ``key`` is None).

        A key that turns out unhashable is treated as None. ``build`` may raise: nothing is
        kept then, so a failing call is checked again each time. (``build`` takes its
        arguments here rather than as a closure: a closure over the caller's arguments
        costs the caller about 0.3 µs on every call, hits included.)"""
        if key is None:
            return build(*args)
        try:
            hit = self.get(key)
        except TypeError:  # an unhashable part: build, keep nothing
            return build(*args)
        if hit is None:
            hit = build(*args)
            if len(self) >= self.max_size:
                self.clear()
            self[key] = hit
        return hit


def typed(x):
    """``x`` with its type, for a key: ``True``, ``1`` and ``1.0`` are equal and hash
    alike, yet the checks refuse some of them where they take others (a plan kept for one
    must not serve the other). Tuples and lists element by element."""
    if isinstance(x, (tuple, list)):
        return type(x), tuple(typed(y) for y in x)
    return type(x), x


def clear_all() -> None:
    """Empty every memo the front end holds."""
    for memo in _ALL:
        memo.clear()
