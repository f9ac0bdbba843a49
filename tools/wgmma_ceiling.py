"""The tensor-core ceilings from Numba on this GPU: Hopper's wgmma (sm_90a) and, beside it,
Ampere's mma.sync, each in a kernel that does nothing but matrix products on operands
already on chip; and a check that the wgmma intrinsics, descriptors and layouts of
backends/numba_cuda/device/wgmma.py compute the right product.

The check (``--check`` alone, or first by default): one warpgroup multiplies a 64 x 64 tile A
by a 64 x N tile B (small integers, so the fp32 result is exact) through four m64nNk16
steps, A and B from shared memory (or A from registers), in each layout the module states
(K-major or MN-major B; no swizzle, 128-byte swizzle), and compares every accumulator, placed
by ``wgmma.acc_coords``, with NumPy's A @ B. Where a layout fails it tries the descriptor
with its two strides swapped and says whether that one passes, and whether the values were
right but misplaced (the accumulator layout) or wrong.

The ceiling: 4 blocks per multiprocessor, each of one or two warpgroups issuing groups of
four m64nNk16 (K = 64 per commit group; bf16, K-major, 128-byte swizzle) on the same tiles,
iterations chosen for about ``--seconds`` per launch, best of three launches; mma.sync
m16n8k16 bf16 the same way (8 warps, 8 independent accumulators per warp). TFLOP/s counts
2 M N K per instruction. Registers and local memory per thread come from the compiled
kernels (local memory > 0 would mean spilled accumulators).

Needs numba-cuda 0.30.4 with NumPy < 2.5 and flashcore importable (an editable install, or
``bash tools/gpu_session.sh wgmma``, which sets both up). Prints a table last; exit status 1
when a check fails, 2 when it cannot run.

Usage: python tools/wgmma_ceiling.py [--check] [--no-check] [--seconds 0.1]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
K_TILE = 64  # the checked tile's K, and the K of one commit group (4 steps of 16)


def fail(msg, code=2):
    print(f"wgmma_ceiling: {msg}", file=sys.stderr, flush=True)
    sys.exit(code)


def import_backends():
    """flashcore.backends, from an install or, failing that, from this checkout (its
    package-dir mapping made by hand: flashcore/ plus backends/ as flashcore.backends)."""
    try:
        import flashcore.backends  # noqa: F401
        return
    except ImportError:
        pass
    import importlib.util

    sys.path.insert(0, str(ROOT))
    import flashcore

    spec = importlib.util.spec_from_file_location(
        "flashcore.backends", ROOT / "backends" / "__init__.py",
        submodule_search_locations=[str(ROOT / "backends")])
    mod = importlib.util.module_from_spec(spec)
    sys.modules["flashcore.backends"] = mod
    flashcore.backends = mod
    spec.loader.exec_module(mod)


def environment():
    """(cuda module, device, its facts line); exits with a clear message where it cannot run."""
    if tuple(int(x) for x in np.__version__.split(".")[:2]) >= (2, 5):
        fail(f"NumPy {np.__version__}: numba-cuda 0.30.4 cannot compile kernels with NumPy "
             ">= 2.5; install numpy<2.5 (tools/README.md: the .whl folder and "
             "`bash tools/gpu_session.sh wgmma`)")
    try:
        from numba import cuda
    except ImportError as e:
        fail(f"numba-cuda is not importable ({e}); pip install 'numba-cuda[cu13]==0.30.4'")
    if cuda.config.ENABLE_CUDASIM:
        fail("NUMBA_ENABLE_CUDASIM is set: wgmma needs a real Hopper GPU")
    try:
        if not cuda.is_available():
            fail("no CUDA GPU is visible (numba.cuda.is_available() is False)")
        dev = cuda.get_current_device()
    except Exception as e:  # noqa: BLE001  (driver missing, no device: say so and stop)
        fail(f"CUDA is not usable: {type(e).__name__}: {e}")
    try:
        import_backends()
    except Exception as e:  # noqa: BLE001
        fail(f"flashcore.backends is not importable: {type(e).__name__}: {e}")
    import numba_cuda

    name = dev.name.decode() if isinstance(dev.name, bytes) else str(dev.name)
    cc = tuple(dev.compute_capability)
    facts = (f"{name}, {dev.MULTIPROCESSOR_COUNT} SMs, cc {cc[0]}.{cc[1]}, "
             f"numba-cuda {numba_cuda.__version__}, NumPy {np.__version__}")
    return cuda, dev, facts


# --- kernels ----------------------------------------------------------------------------

def _kinds():
    from flashcore.backends.numba_cuda.device import wgmma as w

    return {("ss", "bf16"): w.wgmma_ss_bf16, ("ss", "f16"): w.wgmma_ss_f16,
            ("rs", "bf16"): w.wgmma_rs_bf16, ("rs", "f16"): w.wgmma_rs_f16}


#: Shared memory of the check and ceiling kernels, in uint16: 1024 bytes to align the tiles
#: on the 128-byte swizzle's pattern, A (64 x 64) and B (up to 256 x 64).
SMEM_U16 = (1024 + 64 * K_TILE * 2 + 256 * K_TILE * 2) // 2
B_AT = 64 * K_TILE  # uint16 offset of B after the aligned start


def check_kernel(cuda, n, kind, a_in, trans_b):
    """One warpgroup: D (64 x n) = A (64 x 64) B (64 x n) in four k-steps. Descriptor strides,
    swizzles and per-step start offsets are run-time values (``prm``): one compile serves
    every layout with the same instruction. ``prm``: a_lbo, a_sbo, a_swz, b_lbo, b_sbo,
    b_swz, then the 4 A starts and the 4 B starts (bytes)."""
    from flashcore.backends.numba_cuda.device import wgmma as w
    from flashcore.backends.numba_cuda.device.convert import device_function, smem_pointer
    from numba import uint16

    mma = _kinds()[(a_in, kind)]
    m = n // 2
    tb = trans_b
    desc = w.smem_descriptor

    if a_in == "ss":
        @device_function
        def step(acc, a0, b0, ks, tid, a_frag, prm):
            da = desc(a0 + prm[6 + ks], prm[0], prm[1], prm[2])
            db = desc(b0 + prm[10 + ks], prm[3], prm[4], prm[5])
            return mma(acc, da, db, ks, 0, tb)  # ks = 0: scale_d 0 (D = A B)
    else:
        @device_function
        def step(acc, a0, b0, ks, tid, a_frag, prm):
            db = desc(b0 + prm[10 + ks], prm[3], prm[4], prm[5])
            f = 16 * tid + 4 * ks
            return mma(acc, a_frag[f], a_frag[f + 1], a_frag[f + 2], a_frag[f + 3], db, ks,
                       tb)

    def wgmma_check(a_img, b_img, a_frag, prm, out):
        sm = smem_pointer(cuda.shared.array(SMEM_U16, uint16))
        tid = cuda.threadIdx.x
        addr = w.smem_address(sm, 0)
        pad = ((1024 - (addr & 1023)) & 1023) // 2
        for i in range(tid, a_img.size, 128):
            sm[pad + i] = a_img[i]
        for i in range(tid, b_img.size, 128):
            sm[pad + B_AT + i] = b_img[i]
        w.fence_proxy_async()
        cuda.syncthreads()
        a0 = addr + 2 * pad
        b0 = a0 + 2 * B_AT
        acc = w.zero_accumulators(n)
        acc = w.wgmma_fence_acc(acc)
        for ks in range(4):
            acc = step(acc, a0, b0, ks, tid, a_frag, prm)
        w.wgmma_commit_group()
        acc = w.wgmma_wait_group_acc(0, acc)
        for i in range(m):
            out[tid * m + i] = acc[i]

    wgmma_check.__qualname__ = wgmma_check.__name__ = f"wgmma_check_{a_in}_{kind}_n{n}_tb{tb}"
    return cuda.jit(wgmma_check)


def ceiling_kernel(cuda, n, a_in, wait):
    """Each warpgroup of the block: ``iters`` times a fence, four m64nNk16 (bf16, K-major,
    128-byte swizzle; A from shared memory or registers), commit, wait for all but
    ``wait`` groups."""
    from flashcore.backends.numba_cuda.device import wgmma as w
    from flashcore.backends.numba_cuda.device.convert import device_function, smem_pointer
    from numba import uint16, uint32

    mma = _kinds()[(a_in, "bf16")]
    m = n // 2
    desc = w.smem_descriptor
    sw = w.SWIZZLE_128B
    sbo = 8 * 128

    # four k-steps of 16, written out: a loop is not always unrolled (N = 256), and then
    # ptxas moves the accumulators around it (its warning C7519)
    if a_in == "ss":
        @device_function
        def group(acc, a0, b0, r):
            acc = mma(acc, desc(a0, 16, sbo, sw), desc(b0, 16, sbo, sw), 1, 0, 0)
            acc = mma(acc, desc(a0 + 32, 16, sbo, sw), desc(b0 + 32, 16, sbo, sw), 1, 0, 0)
            acc = mma(acc, desc(a0 + 64, 16, sbo, sw), desc(b0 + 64, 16, sbo, sw), 1, 0, 0)
            return mma(acc, desc(a0 + 96, 16, sbo, sw), desc(b0 + 96, 16, sbo, sw), 1, 0, 0)
    else:
        @device_function
        def group(acc, a0, b0, r):
            acc = mma(acc, r, r, r, r, desc(b0, 16, sbo, sw), 1, 0)
            acc = mma(acc, r, r, r, r, desc(b0 + 32, 16, sbo, sw), 1, 0)
            acc = mma(acc, r, r, r, r, desc(b0 + 64, 16, sbo, sw), 1, 0)
            return mma(acc, r, r, r, r, desc(b0 + 96, 16, sbo, sw), 1, 0)

    def wgmma_loop(iters, out):
        sm = smem_pointer(cuda.shared.array(SMEM_U16, uint16))
        tid = cuda.threadIdx.x
        for i in range(tid, SMEM_U16, cuda.blockDim.x):
            # small bf16 values (1 + i/128 scaled by 2^-6), never inf or NaN
            sm[i] = uint16(0x3C80 + (i & 127))
        w.fence_proxy_async()
        cuda.syncthreads()
        addr = w.smem_address(sm, 0)
        a0 = (addr + 1023) & ~1023
        b0 = a0 + 2 * B_AT
        r = uint32(0x3C803C80) + uint32(tid & 7)
        acc = w.zero_accumulators(n)
        acc = w.wgmma_fence_acc(acc)
        for _ in range(iters):
            w.wgmma_fence()
            acc = group(acc, a0, b0, r)
            w.wgmma_commit_group()
            w.wgmma_wait_group(wait)
        acc = w.wgmma_wait_group_acc(0, acc)
        out[cuda.blockIdx.x * cuda.blockDim.x + tid] = acc[0] + acc[m - 1]

    wgmma_loop.__qualname__ = wgmma_loop.__name__ = f"wgmma_loop_{a_in}_n{n}_wait{wait}"
    return cuda.jit(wgmma_loop)


def mma_sync_kernel(cuda):
    """Each warp: ``iters`` times 8 mma.sync m16n8k16 bf16 into 8 independent accumulators."""
    from flashcore.backends.numba_cuda.device.intrinsics import mma_bf16 as mma
    from numba import float32, uint32

    def mma_sync_loop(iters, out):
        tid = cuda.threadIdx.x
        a = uint32(0x3C803C80) + uint32(tid & 7)
        b = uint32(0x3C803C80) + uint32(tid & 3)
        z = float32(0.0)
        c0 = c1 = c2 = c3 = c4 = c5 = c6 = c7 = (z, z, z, z)
        for _ in range(iters):
            c0 = mma(a, a, a, a, b, b, c0[0], c0[1], c0[2], c0[3])
            c1 = mma(a, a, a, a, b, a, c1[0], c1[1], c1[2], c1[3])
            c2 = mma(a, a, a, a, a, b, c2[0], c2[1], c2[2], c2[3])
            c3 = mma(a, a, a, a, a, a, c3[0], c3[1], c3[2], c3[3])
            c4 = mma(b, a, a, a, b, b, c4[0], c4[1], c4[2], c4[3])
            c5 = mma(b, a, a, a, b, a, c5[0], c5[1], c5[2], c5[3])
            c6 = mma(b, a, a, a, a, b, c6[0], c6[1], c6[2], c6[3])
            c7 = mma(b, a, a, a, a, a, c7[0], c7[1], c7[2], c7[3])
        s = c0[0] + c1[1] + c2[2] + c3[3] + c4[0] + c5[1] + c6[2] + c7[3]
        out[cuda.blockIdx.x * cuda.blockDim.x + tid] = s

    return cuda.jit(mma_sync_loop)


# --- the check ---------------------------------------------------------------------------

def _bits(x, kind):
    """float32 small integers -> their 16-bit patterns (exact)."""
    if kind == "f16":
        return x.astype(np.float16).view(np.uint16)
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def _image(mat_bits, rows, cols, mode, w):
    """The shared-memory image (uint16) of ``mat_bits`` (rows x cols) in layout ``mode``."""
    img = np.zeros(rows * cols, np.uint16)
    i, j = np.meshgrid(np.arange(rows), np.arange(cols), indexing="ij")
    off = np.vectorize(lambda a, b: w.tile_offset(int(a), int(b), rows, cols, mode))(i, j)
    img[off.ravel() // 2] = mat_bits.ravel()
    return img


def run_check(cuda, case, rng):
    """One check case ``(a_in, kind, n, b_major, mode)``: returns (status, detail, retry),
    ``retry`` None where it passed, else a function that tries the descriptors with their
    strides swapped and returns what it found. Call the retries last: a descriptor read the
    wrong way may reach past the tiles, and a fault there ends the CUDA context."""
    from flashcore.backends.numba_cuda.device import wgmma as w

    a_in, kind, n, b_major, mode = case
    a = rng.integers(-3, 4, (64, K_TILE)).astype(np.float32)
    b = rng.integers(-3, 4, (K_TILE, n)).astype(np.float32)
    ref = a.astype(np.float64) @ b.astype(np.float64)
    a_mode = mode
    a_img = _image(_bits(a, kind), 64, K_TILE, a_mode, w)
    if b_major == "k":  # Bᵀ (n x K) stored K-major
        b_img = _image(_bits(np.ascontiguousarray(b.T), kind), n, K_TILE, mode, w)
        b_starts = [w.tile_start(0, 16 * s, n, K_TILE, mode) for s in range(4)]
        b_lbo, b_sbo = w.layout_strides("k", n, K_TILE, mode)
    else:  # B (K x n) stored MN-major
        b_img = _image(_bits(b, kind), K_TILE, n, mode, w)
        b_starts = [w.tile_start(16 * s, 0, K_TILE, n, mode) for s in range(4)]
        b_lbo, b_sbo = w.layout_strides("mn", K_TILE, n, mode)
    a_starts = [w.tile_start(0, 16 * s, 64, K_TILE, a_mode) for s in range(4)]
    a_lbo, a_sbo = w.layout_strides("k", 64, K_TILE, a_mode)
    # A in registers: thread t, step s, register r = elements a_coords(t)[2r], [2r + 1]
    ab = _bits(a, kind).astype(np.uint32)
    frag = np.zeros(128 * 16, np.uint32)
    for t in range(128):
        co = w.a_coords(t)
        for s in range(4):
            for r in range(4):
                (i0, k0), (i1, k1) = co[2 * r], co[2 * r + 1]
                frag[16 * t + 4 * s + r] = ab[i0, k0 + 16 * s] | (ab[i1, k1 + 16 * s] << 16)
    kern = check_kernel(cuda, n, kind, a_in, 1 if b_major == "mn" else 0)
    coords = np.array([w.acc_coords(t, n) for t in range(128)])  # [128, n/2, 2]
    dev = [cuda.to_device(x) for x in (a_img, b_img, frag)]

    def attempt(a_strides, b_strides):
        prm = np.array([*a_strides, a_mode, *b_strides, mode, *a_starts, *b_starts], np.int64)
        out = cuda.device_array(128 * (n // 2), np.float32)
        kern[1, 128](*dev, cuda.to_device(prm), out)
        cuda.synchronize()
        got = np.full((64, n), np.nan)
        got[coords[..., 0], coords[..., 1]] = out.copy_to_host().reshape(128, n // 2)
        return got

    got = attempt((a_lbo, a_sbo), (b_lbo, b_sbo))
    if np.array_equal(got, ref):
        return "pass", "", None
    bad = int(np.sum(got != ref))
    detail = f"{bad} of {got.size} wrong"
    if np.array_equal(np.sort(got.ravel()), np.sort(ref.ravel())):
        detail += "; the values are right but misplaced (accumulator layout?)"
    i, j = np.argwhere(got != ref)[0]
    detail += f"; first D[{i},{j}] = {got[i, j]} (want {ref[i, j]})"

    def retry():
        for label, sa, sb in (("A's LBO/SBO swapped", (a_sbo, a_lbo), (b_lbo, b_sbo)),
                              ("B's LBO/SBO swapped", (a_lbo, a_sbo), (b_sbo, b_lbo)),
                              ("both swapped", (a_sbo, a_lbo), (b_sbo, b_lbo))):
            if np.array_equal(attempt(sa, sb), ref):
                return f"passes with {label}"
        return "no stride swap passes"

    return "FAIL", detail, retry


CHECKS = [  # (A in, kind, N, B major, swizzle)
    ("ss", "bf16", 128, "k", 0), ("ss", "bf16", 128, "k", 1),
    ("ss", "bf16", 128, "mn", 0), ("ss", "bf16", 128, "mn", 1),
    ("ss", "f16", 64, "k", 1), ("ss", "bf16", 256, "k", 1),
    ("rs", "bf16", 128, "k", 1), ("rs", "bf16", 128, "mn", 1),
]
SWIZZLE_NAMES = {0: "none", 1: "128B", 2: "64B", 3: "32B"}


def checks(cuda):
    """The check rows ``[name, status, detail]`` and the retries of the failed ones
    (``[(row, retry)]``, for :func:`run_retries` once everything else has run)."""
    rng = np.random.default_rng(0)
    rows, retries = [], []
    for case in CHECKS:
        a_in, kind, n, b_major, mode = case
        name = (f"m64n{n}k16 {kind} A:{'smem' if a_in == 'ss' else 'regs'} "
                f"B:{b_major.upper()}-major swizzle {SWIZZLE_NAMES[mode]}")
        t0 = time.perf_counter()
        try:
            status, detail, retry = run_check(cuda, case, rng)
        except Exception as e:  # noqa: BLE001  (report and go on with the next case)
            status, detail, retry = "ERROR", f"{type(e).__name__}: {str(e)[:300]}", None
        rows.append([name, status, detail])
        if retry is not None:
            retries.append((rows[-1], retry))
        print(f"check {name}: {status} {detail} ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    return rows, retries


def run_retries(retries):
    """Each failed layout again with its strides swapped; the finding joins its row."""
    for row, retry in retries:
        try:
            found = retry()
        except Exception as e:  # noqa: BLE001
            found = f"the retries raised {type(e).__name__}: {str(e)[:200]}"
        row[2] += f"; {found}"
        print(f"check {row[0]}: {found}", flush=True)


# --- the ceiling -------------------------------------------------------------------------

def time_kernel(cuda, kern, grid, block, flops_per_iter, seconds):
    """(TFLOP/s, ms per launch, iterations) of the best of three launches sized for about
    ``seconds`` each."""
    out = cuda.device_array(grid * block, np.float32)

    def launch(iters):
        start, end = cuda.event(), cuda.event()
        start.record()
        kern[grid, block](np.int32(iters), out)
        end.record()
        end.synchronize()
        return cuda.event_elapsed_time(start, end) / 1e3

    launch(16)  # compile, load, warm up
    iters = 256
    t = launch(iters)
    iters = int(min(max(iters * seconds / max(t, 1e-6), 256), 1 << 22))
    best = min(launch(iters) for _ in range(3))
    return flops_per_iter * grid * iters / best / 1e12, best * 1e3, iters


def _kernel_facts(kern):
    try:
        ov = next(iter(kern.overloads.values()))
        return ov.regs_per_thread, ov.local_mem_per_thread
    except Exception:  # noqa: BLE001  (facts only)
        return "?", "?"


def _sass_count(kern, op):
    try:
        return str(kern.inspect_sass(kern.signatures[0]).count(op))
    except Exception:  # noqa: BLE001  (nvdisasm missing: no count)
        return "-"


def ceilings(cuda, dev, seconds, hopper):
    sms = dev.MULTIPROCESSOR_COUNT
    grid = 4 * sms
    rows = []
    plans = []
    if hopper:
        for n, wgs, a_in, wait in ((128, 1, "ss", 0), (128, 2, "ss", 0), (256, 2, "ss", 0),
                                   (256, 2, "ss", 1), (128, 2, "rs", 0), (64, 2, "ss", 0)):
            plans.append((f"wgmma m64n{n}k16 bf16 A:{'smem' if a_in == 'ss' else 'regs'} "
                          f"{wgs} WG wait {wait}",
                          lambda n=n, a_in=a_in, wait=wait: ceiling_kernel(cuda, n, a_in, wait),
                          128 * wgs, wgs * 4 * 2 * 64 * n * 16, "GMMA"))
    plans.append(("mma.sync m16n8k16 bf16 8 warps", lambda: mma_sync_kernel(cuda), 256,
                  8 * 8 * 2 * 16 * 8 * 16, "HMMA"))
    for name, make, block, flops, op in plans:
        t0 = time.perf_counter()
        try:
            kern = make()
            tflops, ms, iters = time_kernel(cuda, kern, grid, block, flops, seconds)
            regs, local = _kernel_facts(kern)
            rows.append((name, block, regs, local, _sass_count(kern, op), f"{tflops:.0f}",
                         f"{ms:.1f}", iters))
        except Exception as e:  # noqa: BLE001  (report and go on with the next kernel)
            rows.append((name, block, "-", "-", "-", "ERROR", "-", "-"))
            print(f"{name}: {type(e).__name__}: {str(e)[:500]}", file=sys.stderr)
        print(f"ceiling {name}: {rows[-1][5]} TFLOP/s ({time.perf_counter() - t0:.1f} s)",
              flush=True)
    return rows


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda r: "  ".join(str(x).ljust(wd) for x, wd in zip(r, widths))  # noqa: E731
    return "\n".join([line(header), line(["-" * wd for wd in widths]),
                      *(line(r) for r in rows)])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only the correctness check")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness check")
    ap.add_argument("--seconds", type=float, default=0.1,
                    help="about how long each timed launch runs (default 0.1)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    cuda, dev, facts = environment()
    print(f"wgmma_ceiling: {facts}", flush=True)
    hopper = tuple(dev.compute_capability) == (9, 0)
    if not hopper:
        msg = (f"compute capability {dev.compute_capability}: wgmma is an sm_90a instruction "
               "(H100/H200 only)")
        if a.check:
            fail(msg)
        print(f"wgmma_ceiling: {msg}; only mma.sync is measured", flush=True)
    check_rows, retries = checks(cuda) if hopper and not a.no_check else ([], [])
    ceiling_rows = [] if a.check else ceilings(cuda, dev, a.seconds, hopper)
    run_retries(retries)  # last: a descriptor read the wrong way may fault
    print()
    print(f"wgmma ceiling from Numba: {facts}; {time.perf_counter() - t_start:.0f} s in all")
    if check_rows:
        print(_table(("check", "result", "detail"), check_rows))
    if ceiling_rows:
        if check_rows:
            print()
        print(_table(("kernel (grid 4 x SMs)", "threads", "regs", "local B", "SASS ops",
                      "TFLOP/s", "ms", "iters"), ceiling_rows))
    if any(r[1] != "pass" for r in check_rows):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
