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


def pytest_runtest_logreport(report):
    """With FLASHCORE_INSTAFAIL=1 (the GPU session driver sets it) a failure's report is
    written when it happens, not at the end: a device call cut off by its time limit still
    says what failed and why."""
    if report.failed and os.environ.get("FLASHCORE_INSTAFAIL") == "1":
        import sys

        sys.stderr.write(f"\n==== FAILED {report.nodeid} ({report.when})\n")
        sys.stderr.write(str(report.longrepr)[-6000:] + "\n")
        sys.stderr.flush()


def pytest_collection_modifyitems(config, items):
    """The CUDA-simulator tests first (marked ``cudasim``: each a subprocess or a long
    simulation, up to ~7 minutes on a 2-core host): under pytest-xdist they then start on
    every worker at once, and the short tests fill in around them, instead of one of them
    starting last and running alone (CI's wall time was that tail)."""
    items.sort(key=lambda item: item.get_closest_marker("cudasim") is None)
