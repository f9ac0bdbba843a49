"""Tile configurations of the CUDA kernels: plain data, chosen per (head dim, dtype, causal,
compute capability), and the shared-memory layout that follows from them.

Every kernel works on a ``block_m x block_n`` tile of the score matrix with a
``rows x cols`` grid of threads; thread ``(r, c)`` owns the ``rm = block_m // rows``
consecutive score rows ``r * rm + a`` and the columns ``c + cols * b`` (``b < block_n //
cols``), and head-dim columns of the output rows it owns: ``c + cols * t`` (``t < dpad /
cols``), or in groups of 4 adjacent ones where the product reads them 16 bytes at a time
(``tile_product.column``). Consecutive rows let a thread fetch its A operand in 16-byte
vector loads, which the lanes sharing ``r`` receive as one broadcast; strided columns put
the lanes of a warp on consecutive shared-memory words of the B operand (no bank
conflicts).

Shared memory holds fp32 tiles. Tiles read as an A operand are stored transposed,
``tile[k][row]``, with rows padded by 4 words (16-byte aligned vector loads). Tiles read
only as a B operand are stored transposed with rows padded by 1 word (an odd stride keeps
column walks on distinct banks) when loaded through registers, or as the global rows,
``tile[row][d]`` with a 16-byte row stride, when streamed by 16-byte ``cp.async`` copies
(:func:`b_tile`).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path

#: Shared memory a block may use by default; more needs an opt-in attribute per kernel.
STATIC_SMEM_LIMIT = 48 * 1024
#: Shared memory a block may opt in to on sm_80 and sm_90 (227 KiB on sm_90, 163 on sm_80).
SMEM_LIMIT = {(8, 0): 163 * 1024, (9, 0): 227 * 1024}
#: Bytes per element of the stored dtypes.
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


def smem_limit(cc) -> int:
    """Bytes of shared memory one block may opt in to on compute capability ``cc``:
    :data:`SMEM_LIMIT` where listed, else 227 KiB on sm_9x, 163 KiB on sm_87 and 99 KiB on
    the other sm_8x and newer consumer parts."""
    cc = tuple(cc)
    if cc in SMEM_LIMIT:
        return SMEM_LIMIT[cc]
    return 163 * 1024 if cc == (8, 7) else 227 * 1024 if cc[0] == 9 else 99 * 1024


def blocks_fit(smem_words: int, blocks: int, cc) -> bool:
    """Whether ``blocks`` blocks of ``smem_words`` fp32 words each fit one SM side by side
    (the driver reserves 1 KiB per block; an SM has 1 KiB more than one block may take)."""
    return blocks * (4 * smem_words + 1024) <= smem_limit(cc) + 1024


def a_ld(n: int) -> int:
    """Row stride of a tile read as an A operand (vector loads: a multiple of 4 words)."""
    return n + 4


def b_ld(n: int) -> int:
    """Row stride of a tile read only as a B operand (odd: conflict-free column walks)."""
    return n + 1


@dataclass(frozen=True)
class Tiles:
    """One kernel's tiling: ``block_m`` query rows x ``block_n`` key rows per step."""

    block_m: int
    block_n: int
    rows: int  # thread rows
    cols: int  # thread columns
    #: blocks per multiprocessor the kernel is compiled for: above 1, ptxas caps registers
    #: at 65536 / (threads * min_blocks) and the kernel asks for the largest shared-memory
    #: carveout, so that that many blocks fit side by side
    min_blocks: int = 1
    #: float32 tiles that stream through shared memory (K, V in the forward and dQ; Q, dO
    #: in dK/dV) are copied with ``cp.async`` (sm_80+) one tile ahead, into a second buffer
    async_copy: bool = False
    #: (dK/dV) P and dS take turns in one shared buffer: a tile of shared memory less, two
    #: barriers more per step
    one_ps_buffer: bool = False
    #: k steps per loop trip of the tile products (4, 8 or 16, where it divides the depth;
    #: 0: 8 for small thread tiles, else 4; tile_product.k_step)
    k_unroll: int = 0

    def __post_init__(self):
        if self.min_blocks < 1:
            raise ValueError(f"min_blocks must be at least 1: {self}")
        if self.k_unroll not in (0, 4, 8, 16):
            raise ValueError(f"k_unroll must be 0, 4, 8 or 16: {self}")
        if self.block_m % self.rows or self.block_n % self.cols:
            raise ValueError(f"tiles must divide among threads: {self}")
        if self.block_m % 4 or self.block_n % 4:
            raise ValueError(f"tile sides must be multiples of 4: {self}")

    @property
    def threads(self) -> int:
        return self.rows * self.cols

    @property
    def launch_bounds(self):
        """numba's ``launch_bounds`` for this tiling: (threads, min_blocks) where the
        registers must be capped (several blocks per SM, or more than 256 threads, which
        cannot launch with more than 128 registers each), else None."""
        if self.min_blocks > 1 or self.threads > 256:
            return (self.threads, self.min_blocks)
        return None

    @property
    def rm(self) -> int:
        """Score rows per thread."""
        return self.block_m // self.rows

    @property
    def rn(self) -> int:
        """Score columns per thread."""
        return self.block_n // self.cols

    def dpad(self, head_dim: int) -> int:
        """Head dim rounded up to a multiple of ``cols`` and of 8 (padded columns hold
        zeros; the tile loaders move 8 columns x 4 rows per warp)."""
        step = self.cols * 8 // _gcd(self.cols, 8)
        return -(-head_dim // step) * step


@dataclass(frozen=True)
class RowTiles:
    """The backward preprocess's tiling (``delta = rowsum(dO * O)``): ``threads`` per block
    (whole warps), ``lanes`` consecutive lanes per row (a power of two up to 32), then a
    sum by shuffles. With ``vector`` each lane takes 16 consecutive bytes of the row per
    step (8 16-bit or 4 fp32 elements: one 16-byte load of O and one of dO where the rows
    are contiguous and 16-byte aligned; else as many scalar loads); without, one element
    per step, lane ``l`` reading elements ``l, l + lanes, ...``. On a GPU as many lanes as
    a 16-bit row has 16-byte pieces (:meth:`for_head_dim`); the simulator takes 4 (each
    simulated thread is a Python thread)."""

    threads: int = 128
    lanes: int = 32
    vector: bool = True

    def __post_init__(self):
        if self.threads % 32 or self.threads <= 0:
            raise ValueError(f"the preprocess takes whole warps; got {self.threads} threads")
        if self.lanes not in (2, 4, 8, 16, 32):
            raise ValueError(f"lanes={self.lanes} is not a power of two from 2 to 32")

    @classmethod
    def for_head_dim(cls, head_dim: int, threads: int = 128) -> "RowTiles":
        """Vector steps with a lane per 16 bytes of a 16-bit row (a power of two, 2 to
        32; fp32 rows take two steps)."""
        lanes = 2
        while lanes < 32 and lanes * 8 < head_dim:
            lanes *= 2
        return cls(threads, lanes)

    def elements(self, dtype: str) -> int:
        """Elements a lane takes per step: 16 bytes of ``dtype``, or 1 (not ``vector``)."""
        return 16 // _ITEMSIZE[dtype] if self.vector else 1

    @property
    def block_m(self) -> int:
        """Rows a block sums."""
        return self.threads // self.lanes

    @property
    def tag(self) -> str:
        return (f"t{self.threads}" + ("" if self.lanes == 32 else f"l{self.lanes}")
                + ("" if self.vector else "s"))


@dataclass(frozen=True)
class KernelTiles:
    """The tilings of the three passes, as chosen for one (head dim, dtype, causal, cc)."""

    forward: Tiles
    dkdv: Tiles  # block_m: key rows owned by a block; block_n: query rows per step
    dq: Tiles  # block_m: query rows owned by a block; block_n: key rows per step
    preprocess: RowTiles = RowTiles()


def _gcd(a, b):
    while b:
        a, b = b, a % b
    return a


def _offsets(*sizes):
    out, at = [], 0
    for n in sizes:
        out.append(at)
        at += n
    return out, at


def forward_layout(t: Tiles, head_dim: int, streamed: bool = False):
    """Offsets and strides (in fp32 words) of attn_forward's shared memory: Q ``[d][i]``
    (A operand of Q Kᵀ), K and V (B operands of both products; one buffer taken in turn,
    or with ``streamed`` one each, so that the next K arrives during this tile's P V), P
    ``[j][i]`` (A operand of P V), and the per-thread partial row maxima and sums. ``KJ``
    and ``KD`` are the strides of K and V along keys and along d (:func:`b_tile`)."""
    dp = t.dpad(head_dim)
    ldq, ldp = a_ld(t.block_m), a_ld(t.block_m)
    kj, kd, kv = b_tile(t.block_n, dp, streamed)
    (q, k, v, p, red), words = _offsets(dp * ldq, kv, kv if streamed else 0,
                                        t.block_n * ldp, t.block_m * t.cols)
    return dict(Q=q, K=k, V=v if streamed else k, P=p, RED=red, LDQ=ldq, KJ=kj, KD=kd,
                LDP=ldp, words=words)


def b_tile(n: int, dp: int, streamed: bool):
    """(stride along rows, stride along d, words) of a tile of ``n`` rows x ``dp`` head-dim columns
    that is read only as a B operand. Loaded through registers it is stored transposed,
    ``[d][row]`` with an odd row stride; streamed by cp.async it keeps the global layout,
    ``[row][d]``, so that 16 bytes of a global row land as 16 bytes of a shared row, with a
    row stride of ``dp + 4`` words (16-byte rows, ``dp / 4 + 1`` odd: a product that reads
    16 bytes of each of 8 consecutive rows touches all 32 banks)."""
    if streamed:
        return a_ld(dp), 1, n * a_ld(dp)
    return 1, b_ld(n), dp * b_ld(n)


def dkdv_layout(t: Tiles, head_dim: int, streamed: bool = False):
    """attn_backward_dkdv: K, V ``[d][key]`` (resident, A operands), Q, dO (streamed, B
    operands; strides ``QJ`` along queries and ``QD`` along d, :func:`b_tile`; with
    ``streamed`` two stages, ``STAGE`` words apart, the next query tile's copies landing in
    one while the other is read), P and dS ``[query][key]`` (A operands; one buffer with
    ``t.one_ps_buffer``), lse and delta."""
    dp = t.dpad(head_dim)
    ldk, ldp = a_ld(t.block_m), a_ld(t.block_m)
    qj, qd, tile = b_tile(t.block_n, dp, streamed)
    stage = 2 * tile
    (k, v, q, do, p, ds, ls, dl), words = _offsets(
        dp * ldk, dp * ldk, tile, tile + (stage if streamed else 0),
        t.block_n * ldp, 0 if t.one_ps_buffer else t.block_n * ldp, t.block_n, t.block_n)
    if t.one_ps_buffer:
        ds = p
    return dict(K=k, V=v, Q=q, DO=do, P=p, DS=ds, LS=ls, DL=dl, LDK=ldk, QJ=qj, QD=qd,
                LDP=ldp, STAGE=stage, words=words)


def dq_layout(t: Tiles, head_dim: int, streamed: bool = False):
    """attn_backward_dq: Q, dO ``[d][query]`` (resident, A operands), K, V (streamed, B
    operands; strides ``KJ``, ``KD`` as in :func:`forward_layout`; two stages ``STAGE``
    words apart with ``streamed``), dS ``[key][query]`` (A operand of dS K)."""
    dp = t.dpad(head_dim)
    ldq, ldp = a_ld(t.block_m), a_ld(t.block_m)
    kj, kd, tile = b_tile(t.block_n, dp, streamed)
    stage = 2 * tile
    (q, do, k, v, ds), words = _offsets(dp * ldq, dp * ldq, tile,
                                        tile + (stage if streamed else 0), t.block_n * ldp)
    return dict(Q=q, DO=do, K=k, V=v, DS=ds, LDQ=ldq, KJ=kj, KD=kd, LDP=ldp, STAGE=stage,
                words=words)


def streams(t: Tiles, dtype: str, aligned: bool = True) -> bool:
    """Whether the kernels of tiling ``t`` copy streamed tiles with cp.async: fp32 only (the
    copy cannot widen fp16/bf16), 16 bytes at a time, so the streamed arrays' rows must be
    contiguous and 16-byte aligned (``aligned``; launch.rows_aligned); otherwise they are
    loaded through registers."""
    return t.async_copy and dtype == "float32" and aligned


def forward_smem_words(t: Tiles, head_dim: int, dtype: str = "float32",
                       aligned: bool = True) -> int:
    return forward_layout(t, head_dim, streams(t, dtype, aligned))["words"]


def dkdv_smem_words(t: Tiles, head_dim: int, dtype: str = "float32",
                    aligned: bool = True) -> int:
    return dkdv_layout(t, head_dim, streams(t, dtype, aligned))["words"]


def dq_smem_words(t: Tiles, head_dim: int, dtype: str = "float32",
                  aligned: bool = True) -> int:
    return dq_layout(t, head_dim, streams(t, dtype, aligned))["words"]


#: Tiny tiles for the CUDA simulator, which runs every thread as a Python thread: they keep
#: several tiles, tails and diagonal tiles in play on the small shapes the tests use, and
#: four rows per thread so that the vector loads run too; fp32 tiles stream (the cp.async
#: paths) and dK/dV shares one P/dS buffer (tests/test_numba_cuda_sim.py covers the others).
SIMULATOR_SIMT = KernelTiles(
    forward=Tiles(block_m=8, block_n=8, rows=2, cols=4, async_copy=True),
    dkdv=Tiles(block_m=8, block_n=4, rows=2, cols=2, async_copy=True, one_ps_buffer=True),
    dq=Tiles(block_m=8, block_n=8, rows=2, cols=4, async_copy=True),
    preprocess=RowTiles(32, 4),  # (8 rows per block, 4 lanes each)
)

#: Per head-dim class (largest head dim it serves): (forward, dK/dV, dQ, causal forward or
#: None) tilings. The sm_90 tilings are the fastest of those timed on an H100/H200
#: (notes/numba_cuda.md, sessions 4-6): fp32 tiles stream by cp.async, the D<=64 forward
#: runs three 128-thread blocks per SM (registers capped at 168); up to 215 KiB of shared
#: memory; the products take 16 k steps per loop trip where that timed faster (D=128
#: forward -3.6%, D=64 forward -5% with the three-block tiling, which the causal D<=64
#: forward keeps at 8).
#: Other GPUs get tilings within sm_80's 163 KiB, loaded through registers (not re-timed
#: since session 1).
_TABLE_SM90 = (
    (64, Tiles(64, 64, 8, 16, 3, True, k_unroll=16),
     Tiles(128, 64, 16, 16, 1, True, k_unroll=16),
     Tiles(128, 64, 16, 16, 1, True, k_unroll=16), Tiles(64, 64, 8, 16, 3, True)),
    (128, Tiles(128, 64, 16, 16, 1, True, k_unroll=16),
     Tiles(64, 64, 8, 32, 1, True, True, k_unroll=16),
     Tiles(128, 32, 16, 16, 1, True, k_unroll=16), None),
    (256, Tiles(32, 32, 8, 16), Tiles(16, 32, 4, 32), Tiles(32, 32, 8, 16), None),
)
_TABLE_SM80 = (
    (64, Tiles(128, 128, 16, 16), Tiles(64, 64, 16, 16), Tiles(128, 64, 16, 16), None),
    (128, Tiles(128, 64, 16, 16), Tiles(64, 32, 16, 16), Tiles(64, 32, 16, 16), None),
    (256, Tiles(32, 32, 8, 16), Tiles(16, 32, 4, 32), Tiles(32, 32, 8, 16), None),
)


def choose_simt(head_dim: int, dtype: str, causal: bool, cc, simulator: bool = False,
                override: KernelTiles | None = None) -> KernelTiles:
    """The tilings for one case. fp16/bf16 inputs are converted to fp32 when tiles are loaded
    (through registers); fp32 inputs on a streaming tiling take a second stage of shared
    memory for the cp.async copies (``streams``)."""
    if override is not None:
        return override
    if simulator:
        return SIMULATOR_SIMT
    table = _TABLE_SM90 if tuple(cc) >= (9, 0) else _TABLE_SM80
    for limit, fwd, dkdv, dq, fwd_causal in table:
        if head_dim <= limit:
            return KernelTiles(forward=fwd_causal if causal and fwd_causal else fwd,
                               dkdv=dkdv, dq=dq, preprocess=RowTiles.for_head_dim(head_dim))
    raise ValueError(f"{head_dim=} exceeds the largest tiled head dim {table[-1][0]}")


# --- tensor-core tilings -------------------------------------------------------------------

#: Row padding of the shared tiles, in elements (16 bytes).
PAD = 8
#: Head dims with tensor-core kernels; others run the SIMT kernels.
HEAD_DIMS = (32, 64, 96, 128, 256)
#: The most fp32 accumulator columns a warp holds per 16 rows of output (256 columns = 128
#: registers per lane): two m-tiles of head dim 128 in the forward, dK and dV of 128
#: columns each in the dK/dV kernel.
MAX_ACC_COLS = 256


@dataclass(frozen=True)
class TCTiles:
    """One tensor-core kernel's tiling: ``warps`` warps of ``16 * m_tiles`` rows each own
    the block's ``block_m`` rows; the other side streams through in steps of ``block_n``
    (keys in the forward and dQ kernels, queries in the dK/dV kernel). With ``m_tiles`` 2,
    each B fragment read from shared memory feeds two MMAs (half the ldmatrix traffic per
    MMA, twice the accumulator registers); only the forward takes ``m_tiles`` 2. The dK/dV
    kernel accumulates the head dim's columns in ``d_splits`` passes over the query steps
    (S and dP recomputed in each), so that dK and dV fit registers at head dim 256."""

    warps: int
    block_n: int
    m_tiles: int = 1
    d_splits: int = 1

    def __post_init__(self):
        if (self.warps < 1 or self.block_n < 16 or self.block_n % 16
                or self.m_tiles not in (1, 2) or self.d_splits not in (1, 2)):
            raise ValueError(f"block_n must be a positive multiple of 16, warps >= 1, "
                             f"m_tiles and d_splits 1 or 2: {self}")

    @property
    def tag(self) -> str:
        """``w4n64``, ``w4n64m2``, ``w4n32s2``: names the tiling in logs and timings."""
        return (f"w{self.warps}n{self.block_n}" + (f"m{self.m_tiles}" if self.m_tiles > 1
                                                    else "")
                + (f"s{self.d_splits}" if self.d_splits > 1 else ""))

    def as_list(self) -> list:
        return [self.warps, self.block_n, self.m_tiles, self.d_splits]

    @property
    def block_m(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps


#: The simulator runs each thread as a Python thread: one warp, small steps, so that the
#: small test shapes still cover several tiles, tails and diagonal tiles.
SIMULATOR_TC = TCTiles(warps=1, block_n=16)

#: The forward's tiling for decoding (a KV-cache call with at most 16 query rows per head,
#: or a group's heads packed as rows): one warp of 16 rows, so that a block computes 16
#: rows, not 128, per key tile it streams (the step is bound by reading the cache), and
#: three blocks fit an SM beside each other where the 128-row tiling fits two.
#: ``FLASHCORE_DECODE_TILES=0`` keeps the table's tiling (for comparisons).
DECODE_TC = TCTiles(warps=1, block_n=64)
DECODE_ENV = "FLASHCORE_DECODE_TILES"


#: Tilings per kernel and (head dim, causal): the autotuner's choices on an H200 at B=4,
#: H=16, N=4096, bf16 (notes/tensor_cores.md: v4 for head dims 64 and 128, where dK/dV at
#: D=64 full keeps w4 n64, 3% behind w4 n32, within the run-to-run spread; v5 for 256; the
#: session-3 tuning of 32 and 96). 256 has one m-tile per warp (its Q fragments are read
#: from shared memory at each k-step) and two column passes in dK/dV. Registers per lane
#: grow with the accumulators (4 * head_dim / 8 fp32 per output tile and m-tile) and the
#: score tiles (4 * block_n / 8 each): the dK/dV kernel holds two of each (up to 255).
_T = TCTiles
FORWARD = {(32, False): _T(4, 64, 2), (32, True): _T(4, 64), (64, False): _T(4, 64, 2),
           (64, True): _T(4, 64, 2), (96, False): _T(8, 64, 2), (96, True): _T(4, 64, 2),
           (128, False): _T(4, 64, 2), (128, True): _T(4, 64, 2),
           (256, False): _T(8, 64), (256, True): _T(8, 64)}
DKDV = {(32, False): _T(4, 64), (32, True): _T(4, 64), (64, False): _T(4, 64),
        (64, True): _T(4, 64), (96, False): _T(4, 64), (96, True): _T(4, 64),
        (128, False): _T(4, 64), (128, True): _T(4, 64),
        (256, False): _T(8, 32, 1, 2), (256, True): _T(8, 32, 1, 2)}
DQ = {(32, False): _T(4, 64), (32, True): _T(4, 32), (64, False): _T(4, 64),
      (64, True): _T(4, 32), (96, False): _T(8, 32), (96, True): _T(4, 64),
      (128, False): _T(4, 32), (128, True): _T(4, 32),
      (256, False): _T(8, 32), (256, True): _T(8, 32)}
TABLES = {"forward": FORWARD, "dkdv": DKDV, "dq": DQ}


_TUNED = None  # load_cache(), read once


def forget_tuned():
    """Drop the tuned tilings read so far (the autotuner calls this after writing)."""
    global _TUNED
    _TUNED = None


def tuned(kernel, head_dim, causal, dtype, gpu, cc):
    """The autotuner's choice for this GPU (autotune.py), or None."""
    global _TUNED
    if _TUNED is None:
        _TUNED = load_cache()
    wn = _TUNED.get(cache_key(gpu, cc, kernel, head_dim, causal, dtype))
    try:
        return None if wn is None else TCTiles(*wn)
    except (TypeError, ValueError):  # a hand-edited cache: ignore the entry
        return None


def choose_tc(kernel: str, head_dim: int, dtype: str, causal: bool, cc=None,
              gpu: str | None = None, simulator: bool = False) -> TCTiles | None:
    """The tiling of ``kernel`` ("forward", "dkdv", "dq") at ``head_dim``: the
    autotuner's cached choice for GPU ``gpu`` of compute capability ``cc`` where there is
    one, else the built-in table (tuned on an H200). Where the table's tiling needs more
    shared memory than ``cc`` has, the largest of the autotuner's candidates that fits
    (None if none does: the SIMT kernels serve)."""
    if simulator:
        if kernel == "dkdv" and dkdv_splits(head_dim) > 1:
            return replace(SIMULATOR_TC, d_splits=dkdv_splits(head_dim))
        return SIMULATOR_TC
    if gpu is not None:
        t = tuned(kernel, head_dim, causal, dtype, gpu, cc)
        if t is not None:
            return t
    t = TABLES[kernel][head_dim, bool(causal)]
    if cc is None or fits(kernel, t, head_dim, cc):
        return t
    fitting = [c for c in CANDIDATES[kernel] if fits(kernel, c, head_dim, cc)]
    return max(fitting, key=lambda c: smem_elements(kernel, c, head_dim), default=None)


def fits(kernel: str, t: TCTiles, head_dim: int, cc) -> bool:
    """Whether tiling ``t`` fits the registers (:func:`fits_registers`) and the shared
    memory of compute capability ``cc``."""
    return (fits_registers(kernel, t, head_dim)
            and 2 * smem_elements(kernel, t, head_dim) <= smem_limit(cc))


def dkdv_splits(head_dim: int) -> int:
    """The fewest column passes that keep the dK/dV kernel's two accumulators within
    :data:`MAX_ACC_COLS`: 1 up to head dim 128, 2 at 256."""
    return max(1, -(-2 * head_dim // MAX_ACC_COLS))


def fits_registers(kernel: str, t: TCTiles, head_dim: int) -> bool:
    """Whether a warp's accumulators stay within :data:`MAX_ACC_COLS` (forward:
    ``m_tiles * head_dim``; dK/dV: ``2 * head_dim / d_splits``, with the fewest passes that
    fit; dQ: ``head_dim``); past it ptxas spills heavily."""
    if kernel == "dkdv":
        need = dkdv_splits(head_dim)
        return t.m_tiles == 1 and t.d_splits == need and head_dim % (16 * need) == 0
    if kernel == "dq":
        return t.m_tiles == 1 and t.d_splits == 1 and head_dim <= MAX_ACC_COLS
    return t.d_splits == 1 and t.m_tiles * head_dim <= MAX_ACC_COLS


def smem_elements(kernel: str, t: TCTiles, head_dim: int) -> int:
    """16-bit elements of shared memory: forward, Q plus double-buffered K and V; dK/dV, K
    and V plus double-buffered Q and dO; dQ, Q and dO plus double-buffered K and V."""
    rows = {"forward": t.block_m + 4 * t.block_n,
            "dkdv": 2 * t.block_m + 4 * t.block_n,
            "dq": 2 * t.block_m + 4 * t.block_n}[kernel]
    return rows * (head_dim + PAD)


# --- Hopper (wgmma) tilings: hopper/tilings.py, re-exported ---------------------------

from .hopper.tilings import (  # noqa: E402, F401
    HOPPER_ALIGN,
    HOPPER_BWD_CANDIDATES,
    HOPPER_BWD_HEAD_DIMS,
    HOPPER_BWD_MASKED,
    HOPPER_BWD_SOFTCAP,
    HOPPER_BWD_USER,
    HOPPER_BWD_USER_VARLEN,
    HOPPER_CANDIDATE_DIMS,
    HOPPER_CANDIDATES,
    HOPPER_DKDV,
    HOPPER_DKDV_ROWS,
    HOPPER_DKDVQ,
    HOPPER_DKDVQ_CANDIDATES,
    HOPPER_DQ,
    HOPPER_FORWARD,
    HOPPER_HEAD_DIMS,
    HOPPER_MASK_MOD,
    HOPPER_ROWS,
    HOPPER_TRIALS,
    LONG_KEYS,
    LONG_KEYS_MIN,
    MASK_MOD_PERSISTENT,
    MASK_MOD_TILES,
    MASKED_OVERLAP,
    NO_TMA,
    PERSISTENT,
    PERSISTENT_TABLES,
    SOFTCAP_KEYS,
    SOFTCAP_POLY,
    TMA_MIN_WORK,
    VARLEN_PERSISTENT,
    VARLEN_PERSISTENT_TRIAL,
    WINDOW_PERSISTENT,
    WINDOW_TILES,
    HopperTiles,
    choose_hopper,
    dkdv_passes,
    hopper_candidates,
    hopper_smem_bytes,
    masked_tiles,
)

# --- the autotuner's cache: its candidates and its choices per GPU ------------------------

#: Tilings tried per kernel: (warps, block_n[, m_tiles[, d_splits]]); those that do not fit
#: a head dim's registers or shared memory are skipped (:func:`fits`). More warps
#: per block share the streamed tiles among more rows; longer steps halve the number of
#: barriers but double the score registers; two m-tiles per warp halve the shared-memory
#: reads per MMA.
CANDIDATES = {
    "forward": [TCTiles(4, 64), TCTiles(8, 64), TCTiles(4, 32), TCTiles(4, 64, 2),
                TCTiles(4, 32, 2), TCTiles(8, 64, 2)],
    "dkdv": [TCTiles(4, 32), TCTiles(4, 64), TCTiles(8, 32), TCTiles(2, 64),
             TCTiles(4, 32, 1, 2), TCTiles(4, 64, 1, 2), TCTiles(8, 32, 1, 2)],
    "dq": [TCTiles(4, 64), TCTiles(4, 32), TCTiles(8, 64), TCTiles(8, 32), TCTiles(4, 16)],
}
FILE = "tc_tiles.json"


def cache_path() -> Path:
    root = os.environ.get("FLASHCORE_CACHE_DIR") or Path.home() / ".cache" / "flashcore"
    return Path(root) / FILE


def cache_key(gpu: str, cc, kernel: str, head_dim: int, causal: bool, dtype: str) -> str:
    return f"{gpu}|sm_{cc[0]}{cc[1]}|{kernel}|d{head_dim}|{'causal' if causal else 'full'}|{dtype}"


def load_cache(path=None) -> dict:
    """``{key: (warps, block_n[, m_tiles[, d_splits]])}`` from the cache file (empty if
    missing or unreadable)."""
    path = cache_path() if path is None else Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: tuple(v["tiles"]) for k, v in data.items()
            if isinstance(v, dict) and len(v.get("tiles", ())) in (2, 3, 4)}
