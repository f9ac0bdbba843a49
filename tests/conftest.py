import os

# Every backend fills its result buffers with NaN before its kernels run (flashcore._poison).
os.environ.setdefault("FLASHCORE_POISON", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_plans():
    """The front end caches each kind of call's checked case and chosen backends
    (flashcore._memo); tests that swap a backend's answers start without them."""
    from flashcore import _memo

    _memo.clear_all()
    yield
    _memo.clear_all()
