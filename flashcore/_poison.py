"""Output poisoning for tests: with ``FLASHCORE_POISON=1`` every backend fills the buffers it
allocates for results with NaN before its kernels run, so an element a kernel forgets to
write shows up as NaN instead of passing by luck (fresh allocations are often zeros)."""
import os

ENABLED = os.environ.get("FLASHCORE_POISON", "") == "1"
