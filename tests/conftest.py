import os
import sys

# Every backend fills its result buffers with NaN before its kernels run (flashcore._poison).
os.environ.setdefault("FLASHCORE_POISON", "1")

# Under numba's CUDA simulator each thread of a block is a Python thread, and the thread
# that launched the kernel polls them in a busy loop (numba/cuda/simulator/kernel.py) while
# holding the GIL, which it hands over only every switch interval (5 ms by default): most of
# a simulated kernel's time went to that wait. A 0.2 ms interval ran a simulated
# tensor-core forward+backward in 7.4 s instead of 29 s (0.5 ms: 7.3 s; 0.05 ms: 11.8 s;
# 2-core AMD EPYC host). It changes only when threads switch, not what they compute.
if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
    sys.setswitchinterval(2e-4)

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
