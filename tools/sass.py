"""Static analysis of the tensor-core kernels without a GPU: PTX (numba compile_ptx) ->
cubin (ptxas) -> SASS (nvdisasm), then registers, spills and an instruction histogram per
kernel, so that a change to a kernel can be judged by what the hardware will execute.

    python tools/sass.py --kernel forward --head-dim 128 [--causal] [--tiles 4,64,2]
        [--dtype bfloat16] [--cc 9.0] [--dump out.sass]

Needs ptxas and nvdisasm on PATH (or FLASHCORE_CUDA_BIN); the pip wheels
nvidia-cuda-nvdisasm / nvidia-cuda-cuobjdump carry nvdisasm.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from pathlib import Path


def _tool(name):
    d = os.environ.get("FLASHCORE_CUDA_BIN")
    exe = str(Path(d) / name) if d else shutil.which(name)
    if not exe or not Path(exe).exists():
        sys.exit(f"{name} not found: put it on PATH or set FLASHCORE_CUDA_BIN")
    return exe


def compile_ptx(kernel, head_dim, causal, dtype, tiles, cc):
    import numba.cuda.dispatcher as nd
    from flashcore.backends.numba_cuda import launch, launch_tc
    from flashcore.backends.numba_cuda import tile_product_tc as tt
    from numba import cuda

    nd.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    if kernel.startswith("attn_"):  # a SIMT kernel (launch.kernel_variants names)
        from flashcore.backends.numba_cuda import tiles as st

        kt = st.choose(head_dim, dtype, causal, cc, simulator=False)
        if tiles is not None:  # the same tiling for every SIMT pass
            kt = st.KernelTiles(forward=tiles, dkdv=tiles, dq=tiles)
        for name, fn, sig, _smem, _threads, bounds in launch.kernel_variants(
                head_dim, dtype, causal, kt):
            if name == kernel:
                return cuda.compile_ptx(fn, sig, cc=cc, fastmath=launch._FASTMATH,
                                        **launch.jit_options(bounds))[0], kt
        raise SystemExit(f"no SIMT kernel {kernel}")
    t = tiles or tt.choose(kernel, head_dim, causal, dtype, cc=cc, simulator=False)
    make, sig_name = launch_tc._MAKERS[kernel]
    fn = make(head_dim, t, causal, dtype)
    ptx, _ = cuda.compile_ptx(fn, launch.signature(sig_name, dtype), cc=cc,
                              fastmath=launch._FASTMATH)
    return ptx, t


def assemble(ptx, cc, workdir, extra=()):
    src = Path(workdir) / "k.ptx"
    cubin = Path(workdir) / "k.cubin"
    for _ in range(2):
        src.write_text(ptx)
        proc = subprocess.run([_tool("ptxas"), f"-arch=sm_{cc[0]}{cc[1]}", "-v", *extra, "-o",
                               str(cubin), str(src)], capture_output=True, text=True)
        m = re.search(r"current version is '([0-9.]+)'", proc.stderr)
        if proc.returncode == 0 or m is None:
            break
        ptx = re.sub(r"^\.version \S+", f".version {m.group(1)}", ptx, flags=re.M)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    return cubin, proc.stderr


def histogram(sass):
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return ops


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="forward",
                    help="forward, dkdv, dq (tensor cores) or a SIMT kernel: attn_forward, "
                         "attn_backward_preprocess, attn_backward_dkdv, attn_backward_dq")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--tiles", help="tensor cores: warps,block_n[,m_tiles[,d_splits]]; "
                    "SIMT: block_m,block_n,rows,cols[,min_blocks[,async_copy[,one_ps_buffer[,k_unroll]]]] "
                    "(all passes)")
    ap.add_argument("--ptxas", default="", help="extra ptxas options, e.g. -maxrregcount=128")
    ap.add_argument("--cc", default="9.0")
    ap.add_argument("--dump", help="write the SASS here")
    a = ap.parse_args(argv)
    from flashcore.backends.numba_cuda.tile_product_tc import TCTiles

    cc = tuple(int(x) for x in a.cc.split("."))
    tiles = None
    if a.tiles:
        nums = [int(x) for x in a.tiles.split(",")]
        if a.kernel.startswith("attn_"):
            from flashcore.backends.numba_cuda.tiles import Tiles
            tiles = Tiles(*nums[:5], *(bool(x) for x in nums[5:7]), *nums[7:8])
        else:
            tiles = TCTiles(*nums)
    ptx, t = compile_ptx(a.kernel, a.head_dim, a.causal, a.dtype, tiles, cc)
    with tempfile.TemporaryDirectory() as d:
        cubin, report = assemble(ptx, cc, d, a.ptxas.split())
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    if a.dump:
        Path(a.dump).write_text(sass)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    ops = histogram(sass)
    print(f"{a.kernel} D={a.head_dim} causal={a.causal} {a.dtype} {t} sm_{cc[0]}{cc[1]}: "
          f"{regs.group(1) if regs else '?'} registers, spill stores/loads "
          f"{spill.group(1) if spill else '?'}/{spill.group(2) if spill else '?'} bytes, "
          f"{sum(ops.values())} instructions")
    print("  " + "  ".join(f"{k} {v}" for k, v in ops.most_common(40)))


if __name__ == "__main__":
    main()
