import os

# Every backend fills its result buffers with NaN before its kernels run (flashcore._poison).
os.environ.setdefault("FLASHCORE_POISON", "1")

import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _fresh_api_plans():
    """The public API caches each kind of call's checked case and chosen backend
    (flashcore._api._plan); tests that swap a backend's answers start without them."""
    from flashcore import _api

    _api._PLANS.clear()
    yield
    _api._PLANS.clear()
