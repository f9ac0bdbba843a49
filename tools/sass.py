"""SASS of the numba_cuda kernels without a GPU: PTX (numba ``compile_ptx``) -> cubin
(``ptxas``) -> SASS (``nvdisasm``), then registers, spills and an instruction histogram per
kernel, so that a change to a kernel can be judged by what the hardware will execute, and a
refactor shown to leave the generated code alone.

One kernel (SIMT kernels are named ``attn_*``; the tensor-core ones forward, dkdv, dq):

    python tools/sass.py --kernel forward --head-dim 128 [--causal] [--tiles 4,64,2]
        [--dtype bfloat16] [--cc 9.0] [--dump out.sass]

Every kernel of a grid (SIMT kernels for float32, tensor-core kernels for fp16/bf16; head
dims, causal and not), one JSON record per kernel (registers, spills, instruction counts,
a hash of the instruction text), and the comparison of two such files or of two commits:

    python tools/sass.py --all [--head-dims 64,128] [--dtypes float32,bfloat16] --json a.json
    python tools/sass.py --compare a.json b.json
    python tools/sass.py --commits main HEAD     # "." is the working tree as it is

``--commits`` exports each commit (``git archive``) into a temporary folder and runs that
commit's own ``tools/sass.py`` there (this one where the commit's has no ``--json``; it
compiles the layered layout of launch.build and variant.Variant, and the flat one before
c975110), so each side compiles its own kernels; the autotuner's cache is left out of both
(a fresh FLASHCORE_CACHE_DIR), so the built-in tilings are compared. Exit status 1 when
any kernel differs.

Needs ptxas and nvdisasm: on PATH, in FLASHCORE_CUDA_BIN, in /usr/local/cuda/bin, or from
the pip wheels nvidia-cuda-nvdisasm (and a CUDA toolkit's ptxas). No GPU is needed: about
15 s of one CPU core per kernel; ``--jobs`` compiles in parallel processes.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import types as pytypes
from pathlib import Path

SIMT_KERNELS = ("attn_forward", "attn_backward_preprocess", "attn_backward_dkdv",
                "attn_backward_dq")
TC_KERNELS = ("forward", "dkdv", "dq")
ROOT = Path(__file__).resolve().parents[1]


def _tool(name):
    d = os.environ.get("FLASHCORE_CUDA_BIN")
    if d:
        exe = Path(d) / name
    else:
        found = shutil.which(name)
        wheel_bins = [Path(p) / "nvidia" / sub / "bin" for p in sys.path if p
                      for sub in ("cu13", "cu12", "cuda_nvcc", "cuda_nvdisasm")]
        exe = Path(found) if found else next(
            (b / name for b in [Path("/usr/local/cuda/bin"), *wheel_bins]
             if (b / name).exists()), None)
    if exe is None or not exe.exists():
        sys.exit(f"{name} not found: put it on PATH or set FLASHCORE_CUDA_BIN")
    return str(exe)


def variant(kernel, head_dim, causal, dtype, tiles, cc):
    """The :class:`variant.Variant` of one kernel as the launches pick it (fp32 SIMT tiles
    streamed where the tiling says so; the autotuner's cache is not read: no GPU name), or
    that kernel under ``tiles`` (SIMT: the same tiling for the pass)."""
    from flashcore.backends.numba_cuda import launch, tilings
    from flashcore.backends.numba_cuda.variant import ENTRY, Variant

    if kernel.startswith("attn_"):  # a SIMT kernel, by its entry name (variant.ENTRY)
        name = {entry: k for k, entry in ENTRY.items()}.get(kernel)
        if name is None:
            raise SystemExit(f"no SIMT kernel {kernel}")
        kt = tilings.choose_simt(head_dim, dtype, causal, cc)
        if tiles is not None:
            kt = tilings.KernelTiles(forward=tiles, dkdv=tiles, dq=tiles)
        return next(v for v in launch.simt_variants(head_dim, dtype, causal, kt)
                    if v.kernel == name)
    if ("tensor_core", kernel) not in launch.FACTORIES:
        raise SystemExit(f"no tensor-core kernel {kernel}")
    t = tiles or tilings.choose_tc(kernel, head_dim, dtype, causal, cc)
    if t is None:
        raise SystemExit(f"no tensor-core tiling of {kernel} fits D={head_dim} on sm_{cc}")
    return Variant(kernel, "tensor_core", head_dim, dtype, causal, t)


def compile_ptx(kernel, head_dim, causal, dtype, tiles, cc):
    """PTX of one kernel and its tiling (the pass's own: a Tiles, a TCTiles or the
    preprocess kernel's tilings.RowTiles)."""
    import numba.cuda.dispatcher as nd
    from numba import cuda

    nd.get_current_device = lambda: pytypes.SimpleNamespace(compute_capability=cc)
    try:
        from flashcore.backends.numba_cuda import driver, launch
    except ImportError:  # a commit before the layered layout (c975110)
        return _compile_ptx_flat(kernel, head_dim, causal, dtype, tiles, cc)
    v = variant(kernel, head_dim, causal, dtype, tiles, cc)
    ptx, _ = cuda.compile_ptx(launch.build(v), launch.signature(v.entry, v.dtype), cc=cc,
                              fastmath=driver.FASTMATH, **driver.jit_options(v.launch_bounds))
    return ptx, v.tiles


def _compile_ptx_flat(kernel, head_dim, causal, dtype, tiles, cc):
    """:func:`compile_ptx` for the flat module layout before c975110 (launch.kernel_variants,
    launch_tc, tiles, tile_product_tc), so that ``--commits`` can compare across it."""
    from flashcore.backends.numba_cuda import launch, launch_tc
    from flashcore.backends.numba_cuda import tile_product_tc as tt
    from numba import cuda

    if kernel.startswith("attn_"):
        from flashcore.backends.numba_cuda import tiles as st

        kt = st.choose(head_dim, dtype, causal, cc, simulator=False)
        if tiles is not None:
            kt = st.KernelTiles(forward=tiles, dkdv=tiles, dq=tiles)
        part = {"attn_forward": "forward", "attn_backward_dkdv": "dkdv",
                "attn_backward_dq": "dq"}.get(kernel, "preprocess_threads")
        for name, fn, sig, _smem, _threads, bounds in launch.kernel_variants(
                head_dim, dtype, causal, kt):
            if name == kernel:
                return cuda.compile_ptx(fn, sig, cc=cc, fastmath=launch._FASTMATH,
                                        **launch.jit_options(bounds))[0], getattr(kt, part)
        raise SystemExit(f"no SIMT kernel {kernel}")
    t = tiles or tt.choose(kernel, head_dim, causal, dtype, cc=cc, simulator=False)
    make, sig_name = launch_tc._MAKERS[kernel]
    ptx, _ = cuda.compile_ptx(make(head_dim, t, causal, dtype),
                              launch.signature(sig_name, dtype), cc=cc,
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


def instruction_text(sass):
    """The instructions alone (no addresses, encodings, labels or section headers; mangled
    symbol names, which hold the Python module path and a per-compile id, as ``<symbol>``;
    runs of blanks as one: nvdisasm pads annotations such as ``(*"SpillRefill"*)`` to the
    longest line, which the symbol names' length sets), one a line: equal for two cubins
    that execute the same code."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            out.append(re.sub(r"\s+", " ", re.sub(r"_Z\w+", "<symbol>", m.group(1))))
    return "\n".join(out)


def analyse(kernel, head_dim, causal, dtype, tiles, cc, ptxas_opts=(), dump=None):
    """One kernel's record: tiling, registers, spill bytes, instruction counts, and a hash
    of its instruction text."""
    ptx, t = compile_ptx(kernel, head_dim, causal, dtype, tiles, cc)
    with tempfile.TemporaryDirectory() as d:
        cubin, report = assemble(ptx, cc, d, ptxas_opts)
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    if dump:
        Path(dump).write_text(sass)
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", report)
    ops = histogram(sass)
    return {
        "kernel": kernel, "head_dim": head_dim, "causal": causal, "dtype": dtype,
        "cc": f"{cc[0]}.{cc[1]}", "tiles": str(t),
        "registers": int(regs.group(1)) if regs else None,
        "spill_stores": int(spill.group(1)) if spill else None,
        "spill_loads": int(spill.group(2)) if spill else None,
        "instructions": sum(ops.values()),
        "sass_sha256": hashlib.sha256(instruction_text(sass).encode()).hexdigest(),
        "ops": dict(ops.most_common()),
    }


def key(r):
    return (f"{r['kernel']} D={r['head_dim']} {'causal' if r['causal'] else 'full'} "
            f"{r['dtype']} sm_{r['cc'].replace('.', '')}")


def line(r):
    return (f"{key(r)}: {r['registers']} registers, spill stores/loads "
            f"{r['spill_stores']}/{r['spill_loads']} bytes, {r['instructions']} instructions")


def grid(head_dims, dtypes, kernels):
    """(kernel, head dim, causal, dtype) of every kernel asked for: ``kernels`` "auto" is
    the SIMT kernels for float32 and the tensor-core kernels for fp16/bf16."""
    jobs = []
    for dtype in dtypes:
        names = kernels or (SIMT_KERNELS if dtype == "float32" else TC_KERNELS)
        for d in head_dims:
            for causal in (False, True):
                jobs += [(k, d, causal, dtype) for k in names
                         if not (causal and k == "attn_backward_preprocess")]
    return jobs


def _job(args):
    (kernel, d, causal, dtype), cc, opts = args
    try:
        return analyse(kernel, d, causal, dtype, None, cc, opts)
    except (Exception, SystemExit) as e:  # noqa: BLE001  (a kernel this commit lacks)
        return {"kernel": kernel, "head_dim": d, "causal": causal, "dtype": dtype,
                "cc": f"{cc[0]}.{cc[1]}", "error": f"{type(e).__name__}: {e}"[:500]}


def run_all(a, cc):
    from concurrent.futures import ProcessPoolExecutor

    jobs = grid([int(x) for x in a.head_dims.split(",")], a.dtypes.split(","),
                a.kernels.split(",") if a.kernels != "auto" else None)
    opts = tuple(a.ptxas.split())
    records = {}
    with ProcessPoolExecutor(max(1, a.jobs)) as ex:
        for r in ex.map(_job, [(j, cc, opts) for j in jobs]):
            records[key(r)] = r
            print(line(r) if "error" not in r else f"{key(r)}: {r['error']}", flush=True)
    return records


def source_info():
    """Which tree was compiled: its commit, whether it had changes, where the backends
    package was imported from."""
    import importlib

    backends = importlib.import_module("flashcore.backends")
    tree = Path(importlib.import_module("flashcore").__file__).resolve().parents[1]

    def git(*args):
        p = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    ptxas = subprocess.run([_tool("ptxas"), "--version"], capture_output=True, text=True)
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "tree": str(tree), "backends": list(backends.__path__),
            "ptxas": next((x for x in ptxas.stdout.splitlines() if "release" in x), None)}


def compare(a, b, name_a="a", name_b="b"):
    """Print what differs between two ``--json`` files; True when every kernel is the same."""
    ka, kb = a["kernels"], b["kernels"]
    same, differ = [], []
    for k in sorted(set(ka) | set(kb)):
        ra, rb = ka.get(k), kb.get(k)
        if ra is None or rb is None:
            differ.append(f"{k}: only in {name_a if rb is None else name_b}")
            continue
        if "error" in ra or "error" in rb:
            differ.append(f"{k}: {ra.get('error', 'ok')} | {rb.get('error', 'ok')}")
            continue
        if ra["sass_sha256"] == rb["sass_sha256"]:
            same.append(k)
            continue
        fields = [f"{f} {ra[f]} -> {rb[f]}" for f in ("registers", "spill_stores",
                                                     "spill_loads", "instructions")
                  if ra[f] != rb[f]]
        ops = collections.Counter(rb["ops"])
        ops.subtract(ra["ops"])
        moved = sorted(((v, op) for op, v in ops.items() if v), key=lambda x: -abs(x[0]))
        differ.append(f"{k}: " + (", ".join(fields) or "same counts, other instructions")
                      + ("; " + " ".join(f"{op} {v:+d}" for v, op in moved[:10])
                         if moved else ""))
    for side, info in ((name_a, a.get("source", {})), (name_b, b.get("source", {}))):
        print(f"{side}: commit {info.get('commit')}{' (with changes)' if info.get('dirty') else ''}"
              f", {info.get('ptxas')}")
    print(f"{len(same)} kernels with the same SASS, {len(differ)} differ")
    for d in differ:
        print("  " + d)
    return not differ


def run_commits(a, cc):
    """``--all --json`` at each of two commits (each exported by ``git archive`` into a
    temporary folder, run with its own tools/sass.py where that one writes JSON), then
    :func:`compare`."""
    passthrough = ["--head-dims", a.head_dims, "--dtypes", a.dtypes, "--kernels", a.kernels,
                   "--cc", a.cc, "--jobs", str(a.jobs)] + (["--ptxas", a.ptxas] if a.ptxas
                                                           else [])
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, FLASHCORE_CACHE_DIR=str(Path(tmp) / "cache"))
        for i, commit in enumerate(a.commits):
            tree, made_link, sha = ROOT, None, None
            if commit != ".":
                sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify",
                                      f"{commit}^{{commit}}"], capture_output=True,
                                     text=True, check=True).stdout.strip()
                tree = Path(tmp) / f"tree{i}"
                tree.mkdir()
                archive = subprocess.run(["git", "-C", str(ROOT), "archive", sha],
                                         capture_output=True, check=True).stdout
                subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
            link = tree / "flashcore" / "backends"
            if (tree / "backends").is_dir() and not link.exists():
                link.symlink_to("../backends")  # the editable install's package-dir mapping
                made_link = link
            try:
                own = tree / "tools" / "sass.py"
                script = own if own.exists() and "--json" in own.read_text() else Path(__file__)
                out = Path(tmp) / f"sass{i}.json"
                print(f"== {commit}: {script}", flush=True)
                subprocess.run([sys.executable, str(script), "--all", "--json", str(out),
                                *passthrough], cwd=tree, check=False,
                               env=dict(env, PYTHONPATH=os.pathsep.join(
                                   [str(tree), env.get("PYTHONPATH", "")])))
                r = json.loads(out.read_text())
            finally:
                if made_link is not None and commit == ".":
                    made_link.unlink()
            if sha:
                r.setdefault("source", {}).update(commit=sha, dirty=False)
            src = r.get("source", {}).get("backends", [""])[0]
            if not src.startswith(str(tree)):
                print(f"warning: {commit} compiled the backends at {src}, not its own")
            results.append(r)
    return compare(*results, *a.commits)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n".join(__doc__.splitlines()[1:]))
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
    ap.add_argument("--all", action="store_true",
                    help="every kernel of the grid --head-dims x --dtypes x causal and not")
    ap.add_argument("--head-dims", default="64,128", help="with --all (default %(default)s)")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="with --all: float32 runs the SIMT kernels, fp16/bf16 the "
                         "tensor-core ones (default %(default)s)")
    ap.add_argument("--kernels", default="auto",
                    help="with --all: kernel names instead of those the dtype picks")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                    help="with --all: parallel compile processes (default %(default)s)")
    ap.add_argument("--json", help="write the records (one per kernel) here")
    ap.add_argument("--compare", nargs=2, metavar="JSON", help="compare two --json files")
    ap.add_argument("--commits", nargs=2, metavar="COMMIT",
                    help="--all at two commits ('.': the working tree), then compare")
    a = ap.parse_args(argv)
    cc = tuple(int(x) for x in a.cc.split("."))
    if a.compare:
        a_, b_ = (json.loads(Path(p).read_text()) for p in a.compare)
        return 0 if compare(a_, b_, *a.compare) else 1
    if a.commits:
        return 0 if run_commits(a, cc) else 1
    if a.all:
        records = run_all(a, cc)
    else:
        tiles = None
        if a.tiles:
            from flashcore.backends.numba_cuda.tilings import TCTiles, Tiles

            nums = [int(x) for x in a.tiles.split(",")]
            if a.kernel.startswith("attn_"):
                tiles = Tiles(*nums[:5], *(bool(x) for x in nums[5:7]), *nums[7:8])
            else:
                tiles = TCTiles(*nums)
        r = analyse(a.kernel, a.head_dim, a.causal, a.dtype, tiles, cc, a.ptxas.split(),
                    a.dump)
        records = {key(r): r}
        print(f"{line(r)}\n  tiles {r['tiles']}")
        print("  " + "  ".join(f"{k} {v}" for k, v in list(r["ops"].items())[:40]))
    if a.json:
        Path(a.json).write_text(json.dumps({"schema": "flashcore-sass/1",
                                            "source": source_info(), "kernels": records},
                                           indent=1))
    return 1 if any("error" in r for r in records.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
