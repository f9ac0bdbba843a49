"""Exceptions a user of flashcore can meet by name."""


class BackendUnavailableError(RuntimeError):
    """A backend was named that cannot run here, or no backend can serve the call.

    The message says why, and for a missing dependency, which extra to install
    (``pip install "flashcore[cuda]"``, say).
    """
