"""The Hopper wgmma intrinsics of backends/numba_cuda/device/wgmma.py.

- Host side (any machine with numba-cuda): the descriptor's bit fields; the accumulator and
  A-fragment layouts cover their tiles once and repeat mma.sync's per warp; the shared-memory
  tiles, read back through the PTX ISA's canonical layouts (transcribed here from its table,
  independently of the module's formulas) at each k-step's descriptor, give the matrix.
- Without a GPU: kernels using every intrinsic, and tools/wgmma_ceiling.py's kernels, compile
  for sm_90a (compile_ptx with cc=(9, 0, "a")); the PTX has the instructions and no local
  memory; where ptxas is installed, it assembles them for sm_90a with no spills (and refuses
  the same PTX for plain sm_90).
- Under the CUDA simulator (a subprocess): the device names raise a clear error.
- On an H100/H200 (marked ``gpu``): the tool's check, every layout against NumPy.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from pathlib import Path

import numpy as np
import pytest

SIM = os.environ.get("NUMBA_ENABLE_CUDASIM", "") not in ("", "0")
pytestmark = pytest.mark.skipif(importlib.util.find_spec("numba_cuda") is None,
                                reason="numba-cuda is not installed")
ROOT = Path(__file__).resolve().parent.parent


def _wgmma():
    from flashcore.backends.numba_cuda.device import wgmma

    return wgmma


# --- host side ---------------------------------------------------------------------------

def test_descriptor_fields():
    w = _wgmma()
    d = w.descriptor_value(0x1400, 16, 1024, w.SWIZZLE_128B)
    assert d == (0x1400 >> 4) | (1 << 16) | ((1024 >> 4) << 32) | (1 << 62)
    d = w.descriptor_value(0x3FFF0, 2048, 128, w.SWIZZLE_NONE)
    assert d & 0x3FFF == 0x3FFF and (d >> 16) & 0x3FFF == 128 and (d >> 32) & 0x3FFF == 8
    assert d >> 62 == 0 and (d >> 49) & 7 == 0  # base offset 0
    assert w.descriptor_value(0x40000 + 0x100, 16, 16, 3) & 0x3FFF == 0x10  # 18 bits kept


@pytest.mark.parametrize("n", [8, 64, 128, 256])
def test_accumulator_layout(n):
    from flashcore.backends.numba_cuda.device.intrinsics import c_coords

    w = _wgmma()
    cells = [rc for t in range(128) for rc in w.acc_coords(t, n)]
    assert sorted(cells) == [(i, j) for i in range(64) for j in range(n)]
    for t in range(128):  # each warp: 16 rows, mma.sync's m16n8 C layout per 8 columns
        for i, (row, col) in enumerate(w.acc_coords(t, n)):
            r, c = c_coords(t % 32)[i % 4]
            assert (row, col) == (16 * (t // 32) + r, 8 * (i // 4) + c)


def test_a_fragment_layout():
    from flashcore.backends.numba_cuda.device.intrinsics import a_coords

    w = _wgmma()
    cells = [rc for t in range(128) for rc in w.a_coords(t)]
    assert sorted(cells) == [(i, k) for i in range(64) for k in range(16)]
    for t in range(128):
        assert w.a_coords(t) == [(16 * (t // 32) + r, k) for r, k in a_coords(t % 32)]


def _canonical(major, mode, start, lbo, sbo, i, j):
    """Byte address of element (i, j) of one wgmma operand (K-major: i = M/N row, j = k;
    MN-major: i = k, j = n) per the PTX ISA's canonical layouts (16-bit elements, T = 8):
    K-major none ((8,m),(T,2k)):((1T,SBO),(1,LBO)); K-major swizzled ((8,m),(T,2k)):
    ((S/16 T,SBO),(1,T)); MN-major none ((T,1,m),(8,k)):((1,T,SBO),(1T,LBO)); MN-major
    swizzled ((T,S/16,m),(8,k)):((1,T,LBO),(S/16 T,SBO)); then Swizzle<log2(S/16),4,3> on
    the byte address."""
    s = {1: 128, 2: 64, 3: 32}.get(mode)
    if major == "k":
        if s is None:
            off = (i % 8) * 16 + (i // 8) * sbo + (j % 8) * 2 + (j // 8) * lbo
        else:
            off = (i % 8) * s + (i // 8) * sbo + j * 2  # the 16 k of a step lie in one line
    elif s is None:
        off = (j % 8) * 2 + (j // 8) * sbo + (i % 8) * 16 + (i // 8) * lbo
    else:
        off = (j % (s // 2)) * 2 + (j // (s // 2)) * lbo + (i % 8) * s + (i // 8) * sbo
    addr = start + off
    bits = {1: 0x70, 2: 0x30, 3: 0x10}.get(mode, 0)
    return addr ^ ((addr >> 3) & bits)


@pytest.mark.parametrize("mode", [0, 1, 2, 3], ids=["none", "128B", "64B", "32B"])
@pytest.mark.parametrize("major,rows,cols", [("k", 64, 64), ("k", 128, 64), ("k", 256, 64),
                                             ("mn", 64, 64), ("mn", 64, 128),
                                             ("mn", 64, 256)])
def test_tiles_read_back_through_the_canonical_layout(major, rows, cols, mode):
    w = _wgmma()
    offs = np.array([[w.tile_offset(i, j, rows, cols, mode) for j in range(cols)]
                     for i in range(rows)])
    assert sorted(offs.ravel() // 2) == list(range(rows * cols))  # a bijection, 2-byte cells
    lbo, sbo = w.layout_strides(major, rows, cols, mode)
    steps = cols // 16 if major == "k" else rows // 16
    for s in range(steps):  # each k-step of 16 that one wgmma reads
        if major == "k":
            start = w.tile_start(0, 16 * s, rows, cols, mode)
            cells = [(i, 16 * s + kk, i, kk) for i in range(rows) for kk in range(16)]
        else:
            start = w.tile_start(16 * s, 0, rows, cols, mode)
            cells = [(16 * s + kk, n, kk, n) for kk in range(16) for n in range(cols)]
        for i, j, ci, cj in cells:
            assert _canonical(major, mode, start, lbo, sbo, ci, cj) == offs[i, j], (
                f"step {s}: element ({i}, {j})")


def test_swizzle_stays_in_its_pattern():
    w = _wgmma()
    for mode, span in ((1, 1024), (2, 512), (3, 256)):
        for off in range(0, 4096, 16):
            sw = w.swizzle(off, mode)
            assert sw // span == off // span and w.swizzle(sw, mode) == off
    assert w.swizzle(0x3F0, 0) == 0x3F0


def _tool():
    spec = importlib.util.spec_from_file_location("wgmma_ceiling",
                                                  ROOT / "tools" / "wgmma_ceiling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class _EmulatedCuda:
    """What ``tools/wgmma_ceiling.run_check`` asks of numba.cuda, with its check kernel
    replaced by NumPy reading the tiles through the canonical layouts (``swap_mn``: as if the
    hardware took an MN-major B's two strides the other way round)."""

    class Array(np.ndarray):
        def copy_to_host(self):
            return np.asarray(self).copy()

    def __init__(self, swap_mn=False):
        self.swap_mn = swap_mn

    def to_device(self, x):
        return np.array(x).view(self.Array)

    def device_array(self, n, dtype):
        return np.full(n, np.nan, dtype).view(self.Array)

    def synchronize(self):
        pass

    def kernel(self, n, kind, a_in, trans_b):
        w = _wgmma()
        emu = self

        def decode(bits):
            bits = np.asarray(bits, np.uint16)
            if kind == "f16":
                return bits.view(np.float16).astype(np.float64)
            return (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)

        def at(img, addr):  # (past the tile: other shared memory, taken as zeros)
            return img[addr // 2] if addr // 2 < img.size else 0

        def run(a_img, b_img, frag, prm, out):
            d = np.zeros((64, n))
            b_major = "mn" if trans_b else "k"
            swap = emu.swap_mn and b_major == "mn"
            b_lbo, b_sbo = (prm[4], prm[3]) if swap else (prm[3], prm[4])
            for s in range(4):
                if a_in == "ss":
                    a = decode([[at(a_img, _canonical("k", prm[2], prm[6 + s], prm[0], prm[1],
                                                    i, k)) for k in range(16)]
                                for i in range(64)])
                else:
                    a = np.zeros((64, 16))
                    for t in range(128):
                        for e, (i, k) in enumerate(w.a_coords(t)):
                            reg = int(frag[16 * t + 4 * s + e // 2])
                            a[i, k] = decode([(reg >> (16 * (e % 2))) & 0xFFFF])[0]
                if b_major == "k":
                    b = decode([[at(b_img, _canonical("k", prm[5], prm[10 + s], b_lbo, b_sbo,
                                                    j, k)) for j in range(n)]
                                for k in range(16)])
                else:
                    b = decode([[at(b_img, _canonical("mn", prm[5], prm[10 + s], b_lbo, b_sbo,
                                                    k, j)) for j in range(n)]
                                for k in range(16)])
                d = a @ b + (d if s else 0)
            for t in range(128):
                for i, (r, c) in enumerate(w.acc_coords(t, n)):
                    out[t * (n // 2) + i] = d[r, c]

        class Launch:
            def __getitem__(self, config):
                assert tuple(config) == (1, 128)
                return run

        return Launch()


def test_check_tool_host_side_against_an_emulated_wgmma(monkeypatch):
    tool = _tool()
    emu = _EmulatedCuda()
    monkeypatch.setattr(tool, "check_kernel", lambda cuda, *a: emu.kernel(*a))
    rng = np.random.default_rng(1)
    for case in tool.CHECKS:
        assert tool.run_check(emu, case, rng) == ("pass", "", None), case
    # a layout read the other way round is reported, with the strides that would pass
    emu.swap_mn = True
    status, detail, retry = tool.run_check(emu, ("ss", "bf16", 64, "mn", 0), rng)
    assert status == "FAIL" and "wrong" in detail, detail
    assert retry() == "passes with B's LBO/SBO swapped"


def test_check_tool_main_prints_its_table_last(monkeypatch, capsys):
    tool = _tool()
    emu = _EmulatedCuda(swap_mn=True)
    monkeypatch.setattr(tool, "check_kernel", lambda cuda, *a: emu.kernel(*a))
    monkeypatch.setattr(tool, "CHECKS", [("ss", "bf16", 64, "k", 1),
                                         ("ss", "bf16", 64, "mn", 0)])
    dev = pytypes.SimpleNamespace(compute_capability=(9, 0))
    monkeypatch.setattr(tool, "environment", lambda: (emu, dev, "an emulated H100"))
    assert tool.main(["--check"]) == 1  # the MN-major one fails with B's strides swapped
    out = capsys.readouterr().out.splitlines()
    assert out[-4].split()[:3] == ["check", "result", "detail"]
    assert out[-2].split()[6] == "pass"
    assert "FAIL" in out[-1] and out[-1].endswith("passes with B's LBO/SBO swapped")


def test_simulator_names_raise_clearly():
    code = ("from flashcore.backends.numba_cuda.device import wgmma as w\n"
            "assert w.descriptor_value(1024, 16, 1024, 1) == int(w.smem_descriptor(1024, 16,"
            " 1024, 1))\n"
            "try:\n    w.wgmma_fence()\nexcept NotImplementedError as e:\n    print(e)\n")
    env = dict(os.environ, NUMBA_ENABLE_CUDASIM="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "simulator cannot run" in proc.stdout


# --- PTX for sm_90a, without a GPU --------------------------------------------------------

def _ptxas(ptx, arch):
    """(return code, report) of ``ptxas -arch=<arch> -v`` on ``ptx`` (None without ptxas).
    A PTX ``.version`` newer than ptxas knows is lowered to the one it names."""
    exe = shutil.which("ptxas")
    if exe is None:
        return None
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        for _ in range(2):
            src.write_text(ptx)
            proc = subprocess.run([exe, f"-arch={arch}", "-v", "-o", str(Path(d) / "k.cubin"),
                                   str(src)], capture_output=True, text=True, check=False)
            m = re.search(r"current version is '([0-9.]+)'", proc.stderr)
            if proc.returncode == 0 or m is None:
                break
            ptx = re.sub(r"^\.version \S+", f".version {m.group(1)}", ptx, flags=re.M)
    return proc.returncode, proc.stderr


def _assembles_clean(ptx, spill=0):
    """ptxas (where installed) takes the PTX for sm_90a: no stack frame and no spills
    (``spill``: at most that many bytes of each), and no warpgroup.arrive it had to inject
    (C7519: accumulators touched between wgmmas)."""
    res = _ptxas(ptx, "sm_90a")
    if res is None:
        return
    rc, report = res
    assert rc == 0, f"ptxas failed:\n{report[-3000:]}"
    used = re.findall(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill "
                      r"loads", report)
    assert used and max(int(x) for line in used for x in line) <= spill, report
    assert "C7519" not in report and "serialized" not in report, report


if not SIM:
    from numba import cuda, uint16, uint32
    from numba.cuda import types

    @pytest.fixture
    def sm90(monkeypatch):
        """Device helpers are typed against the current GPU's compute capability; without
        one, answer 9.0 (the kernels are compiled for cc=(9, 0, "a"))."""
        import numba.cuda.dispatcher as nd

        monkeypatch.setattr(nd, "get_current_device",
                            lambda: pytypes.SimpleNamespace(compute_capability=(9, 0)))

    def _compile(fn, sig):
        try:
            ptx, _ = cuda.compile_ptx(fn, sig, cc=(9, 0, "a"))
        except Exception as e:
            if "NVVM" in str(e) or "libnvvm" in str(e).lower():
                pytest.skip(f"the CUDA toolkit (NVVM) is not importable: {e}")
            raise
        assert ".target sm_90a" in ptx
        assert ".local" not in ptx, "accumulators went to local memory"
        return ptx

    def _probe(kind, n, trans_b, a_in):
        """A kernel that uses every intrinsic once: two wgmma steps (SS or RS), the fences,
        commit and both waits."""
        from flashcore.backends.numba_cuda.device import wgmma as w
        from flashcore.backends.numba_cuda.device.convert import smem_pointer

        ss = {"bf16": w.wgmma_ss_bf16, "f16": w.wgmma_ss_f16}[kind]
        rs = {"bf16": w.wgmma_rs_bf16, "f16": w.wgmma_rs_f16}[kind]
        use_rs = a_in == "rs"
        m = n // 2

        def probe(a, out):
            sm = smem_pointer(cuda.shared.array(16384, uint16))
            tid = cuda.threadIdx.x
            for i in range(tid, 16384, 128):
                sm[i] = uint16(a[i % 64])
            w.fence_proxy_async()
            cuda.syncthreads()
            base = (w.smem_address(sm, 0) + 1023) & ~1023
            da = w.smem_descriptor(base, 16, 1024, w.SWIZZLE_128B)
            db = w.smem_descriptor(base + 8192, 16, 1024, w.SWIZZLE_128B)
            da2 = w.smem_descriptor(base + 32, 16, 1024, w.SWIZZLE_128B)
            db2 = w.smem_descriptor(base + 8192 + 32, 16, 1024, w.SWIZZLE_128B)
            r = uint32(a[tid % 64])
            acc = w.zero_accumulators(n)
            acc = w.wgmma_fence_acc(acc)
            w.wgmma_fence()
            if use_rs:
                acc = rs(acc, r, r, r, r, db, 0, trans_b)
                acc = rs(acc, r, r, r, r, db2, 1, trans_b)
            else:
                acc = ss(acc, da, db, 0, 0, trans_b)
                acc = ss(acc, da2, db2, 1, 0, trans_b)
            w.wgmma_commit_group()
            w.wgmma_wait_group(1)
            acc = w.wgmma_wait_group_acc(0, acc)
            out[tid] = acc[0] + acc[m - 1]

        probe.__qualname__ = probe.__name__ = f"probe_{a_in}_{kind}_n{n}_tb{trans_b}"
        return probe

    @pytest.mark.parametrize("a_in", ["ss", "rs"])
    @pytest.mark.parametrize("kind,n,trans_b", [("bf16", 64, 0), ("bf16", 128, 1),
                                                ("f16", 128, 0), ("bf16", 256, 0)])
    def test_intrinsics_ptx(sm90, kind, n, trans_b, a_in):
        ptx = _compile(_probe(kind, n, trans_b, a_in), (types.uint16[::1], types.float32[::1]))
        mma = [ln for ln in ptx.splitlines() if "wgmma.mma_async" in ln]
        assert len(mma) == 2
        assert all(f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}" in ln
                   for ln in mma)
        assert all(ln.count("%f") == n // 2 for ln in mma)  # the accumulators, in place
        assert all(ln.rstrip().endswith(f", {trans_b}; }}") for ln in mma)
        for instr in ("wgmma.fence.sync.aligned;", "wgmma.commit_group.sync.aligned;",
                      "wgmma.wait_group.sync.aligned 1;", "wgmma.wait_group.sync.aligned 0;",
                      "fence.proxy.async.shared::cta;"):
            assert instr in ptx, f"{instr} missing from the PTX"
        _assembles_clean(ptx)

    def test_plain_sm90_is_refused(sm90):
        """Why the "a": ptxas takes the wgmma PTX only for sm_90a."""
        ptx = _compile(_probe("bf16", 64, 0, "ss"), (types.uint16[::1], types.float32[::1]))
        res = _ptxas(ptx.replace(".target sm_90a", ".target sm_90"), "sm_90")
        if res is None:
            pytest.skip("ptxas is not installed")
        rc, report = res
        assert rc != 0 and "not supported on .target 'sm_90'" in report, report

    @pytest.mark.parametrize("n,a_in,wait", [(64, "ss", 0), (128, "rs", 0), (256, "ss", 1)])
    def test_ceiling_kernels_ptx(sm90, n, a_in, wait):
        ptx = _compile(_tool().ceiling_kernel(cuda, n, a_in, wait).py_func,
                       (types.int32, types.float32[::1]))
        assert ptx.count(f"wgmma.mma_async.sync.aligned.m64n{n}k16") >= 4
        assert f"wgmma.wait_group.sync.aligned {wait};" in ptx
        _assembles_clean(ptx)

    @pytest.mark.parametrize("a_in,kind,n,trans_b", [("ss", "bf16", 128, 1),
                                                     ("rs", "f16", 64, 0)])
    def test_check_kernels_ptx(sm90, a_in, kind, n, trans_b):
        """The tool's check kernels compile (ptxas may inject a warpgroup.arrive there: A's
        registers are loaded between the wgmma steps)."""
        ptx = _compile(_tool().check_kernel(cuda, n, kind, a_in, trans_b).py_func,
                       (types.uint16[::1], types.uint16[::1], types.uint32[::1],
                        types.int64[::1], types.float32[::1]))
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.{kind}.{kind}" in ptx
        res = _ptxas(ptx, "sm_90a")
        assert res is None or res[0] == 0, res

    @pytest.mark.gpu
    def test_check_on_hopper():
        from flashcore.backends import numba_cuda

        reason = numba_cuda.unavailable_reason()
        if reason is not None:
            pytest.skip(reason)
        if tuple(cuda.get_current_device().compute_capability) != (9, 0):
            pytest.skip("wgmma needs compute capability 9.0 (sm_90a: H100, H200)")
        tool = _tool()
        rows, retries = tool.checks(cuda)
        tool.run_retries(retries)
        bad = [r for r in rows if r[1] != "pass"]
        assert not bad, "\n".join(" ".join(map(str, r)) for r in bad)
