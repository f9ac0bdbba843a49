"""A last writable place for numba's disk cache of flashcore's kernels.

Numba keeps a ``cache=True`` function's compiled code in the first of these it can write:
``NUMBA_CACHE_DIR``; ``__pycache__`` beside the source file; the user's cache directory
(``~/.cache/numba``, or ``$XDG_CACHE_HOME/numba``). flashcore installed into a read-only
site-packages falls back to the user's cache directory, which works. Where that is not
writable either (a container whose user has ``HOME=/`` or ``/nonexistent``), numba has no
place at all and refuses to define the kernels: importing them raises ``RuntimeError:
cannot cache function ...: no locator available``, so no numba call can run.

:func:`install` adds one more place, after the user's cache directory and for flashcore's
own source files only: ``flashcore-numba-cache-<uid>`` in the temporary directory, made
with mode 0700 and used only if this user owns it and nobody else may write it (numba's
cache files are pickles: loading someone else's would run their code).
"""
from __future__ import annotations

import os
import stat
import sys
import tempfile

_INSTALLED: set = set()


def fallback_dir() -> str:
    """``<tempdir>/flashcore-numba-cache-<uid>``: the place :func:`install` adds."""
    who = os.getuid() if hasattr(os, "getuid") else os.environ.get("USERNAME", "user")
    return os.path.join(tempfile.gettempdir(), f"flashcore-numba-cache-{who}")


def _private(path: str) -> bool:
    """``path`` exists or was made, is a directory of this user's, and only they write it."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
        st = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISDIR(st.st_mode):
        return False
    if hasattr(os, "getuid") and (st.st_uid != os.getuid() or st.st_mode & 0o022):
        return False
    return True


def _roots() -> tuple:
    """The directories of flashcore's sources (the front end and, installed or editable,
    the backends)."""
    import flashcore.backends  # (binds flashcore too)

    return tuple(os.path.realpath(p) for p in (*flashcore.__path__,
                                              *flashcore.backends.__path__))


def _locator(base, roots):
    """A numba cache locator like ``base`` (numba's user-wide one) in :func:`fallback_dir`,
    for files under ``roots`` only."""

    class FlashcoreFallbackLocator(base):
        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            self._cache_path = os.path.join(fallback_dir(),
                                            self.get_suitable_cache_subpath(py_file))

        @classmethod
        def from_function(cls, py_func, py_file):
            real = os.path.realpath(py_file)
            if not any(real.startswith(r + os.sep) for r in roots):
                return None
            if not _private(fallback_dir()):
                return None
            return super().from_function(py_func, py_file)

    return FlashcoreFallbackLocator


def install(cuda: bool = False) -> None:
    """Add the fallback locator to numba's CPU cache (and numba-cuda's, with ``cuda``, if
    numba-cuda is installed), right after the user-wide locator; once per process."""
    modules = ["numba.core.caching"] + (["numba.cuda.core.caching"] if cuda else [])
    for name in modules:
        if name in _INSTALLED:
            continue
        try:
            __import__(name)
        except ImportError:  # (numba-cuda not installed; the CPU side always is)
            continue
        mod = sys.modules[name]
        impl = getattr(mod, "CacheImpl", None) or mod._CacheImpl  # (older numba)
        classes = impl._locator_classes
        at = [i for i, c in enumerate(classes) if c.__name__.endswith("UserWideCacheLocator")]
        if at:  # (a numba whose locators we do not recognise is left as it is)
            classes.insert(at[0] + 1, _locator(classes[at[0]], _roots()))
        _INSTALLED.add(name)
