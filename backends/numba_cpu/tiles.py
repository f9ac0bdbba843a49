"""Tile configurations of the CPU kernels, as data.

A query tile of ``block_q`` rows meets key/value tiles of ``block_k`` rows, and every tile
product is one BLAS call of ``block_q * block_k * head_dim`` multiply-adds. The kernels are
already parallel over (batch, head, tile), so each BLAS call must stay on its own thread:
OpenBLAS (SciPy's, which Numba calls) runs a product on one thread only while
``M * N * K <= 65536 * 4``; above that it starts its own threads inside ours, and on the
2-core test machine a forward pass went from 0.26 s to 14.7 s. Tiles are the largest that
stay under that bound (measurements in notes/numba_cpu.md).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .simd import host_vector_bits, lanes

#: OpenBLAS's single-thread bound on M*N*K for one GEMM (SMP_THRESHOLD_MIN * 4).
BLAS_SINGLE_THREAD_MNK = 65536 * 4

#: The row block of products.py (its ROWS): query tiles of the kernels that call it are a
#: multiple of it (every candidate below is; decode_tiles rounds up to it). 8 where the host
#: has 32 vector registers (AVX-512), 4 elsewhere (products.py says why).
PRODUCT_ROWS = 8 if host_vector_bits() >= 512 else 4

#: Forward (block_q, block_k) candidates, best first: long key tiles first (longer softmax
#: rows, a longer inner dimension for P @ V), then tall query tiles. At D=128, 32x64 ran
#: 21% faster than 64x32; at D=64, 32x128 5% faster than 64x64 (notes/numba_cpu.md).
FORWARD_CANDIDATES = ((128, 128), (64, 128), (32, 128), (64, 64), (32, 64), (32, 32),
                      (16, 32), (16, 16))
#: Backward candidates: square-ish tiles. The dK/dV pass loops over query tiles inside a
#: key tile, and 32-row query tiles made forward+backward 15% slower at D=64.
BACKWARD_CANDIDATES = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 16),
                       (16, 16))


@dataclass(frozen=True)
class TileConfig:
    """Tiles of the forward pass and of both backward passes (dK/dV and dQ share theirs)."""

    block_q: int
    block_k: int
    bwd_block_q: int
    bwd_block_k: int

    def __post_init__(self):
        if min(self.block_q, self.block_k, self.bwd_block_q, self.bwd_block_k) < 1:
            raise ValueError(f"tile sizes must be positive; got {self}")


def _largest(candidates, head_dim):
    """The first candidate whose products stay single-threaded in BLAS."""
    for bq, bk in candidates:
        if bq * bk * head_dim <= BLAS_SINGLE_THREAD_MNK:
            return bq, bk
    return candidates[-1]


@functools.cache
def choose_tiles(head_dim: int, dtype: str, causal: bool) -> TileConfig:
    return TileConfig(*_largest(FORWARD_CANDIDATES, head_dim),
                      *_largest(BACKWARD_CANDIDATES, head_dim))


#: Query rows one forward job may own (each key/value tile it loads serves all of them).
MAX_ROWS_PER_JOB = 512
#: A forward job's fixed cost (loading and padding its key/value tiles) in units of one
#: query tile's products over the same keys: 0.14 at D=64, 0.16 at D=128 (one thread,
#: N=1024, 1 against 16 query tiles per job; notes/numba_cpu.md, 2026-11-26).
JOB_COST = 0.15


def q_tiles_per_job(n_tiles: int, threads: int, block_q: int, heads: int = 0) -> int:
    """Query tiles per forward job. ``heads`` (batch x query heads) given: the jobs cost
    alike (dense, non-causal), and Numba hands each thread an equal run of them, so the
    size whose busiest thread has the least work, :data:`JOB_COST` per job included (ties
    to the smaller jobs). Otherwise (causal, masks: jobs of different costs) as many tiles
    as keeps at least 4 jobs per thread, for the balance."""
    cap = MAX_ROWS_PER_JOB // block_q
    threads = max(threads, 1)
    if heads < 1:
        return max(1, min(cap, n_tiles // (4 * threads)))
    per_head = max(1, -(-n_tiles // heads))
    best, choice = None, 1
    for per in range(1, min(cap, per_head) + 1):
        jobs = heads * -(-per_head // per)
        cost = -(-jobs // threads) * (per + JOB_COST)
        if best is None or cost < best - 1e-9:
            best, choice = cost, per
    return choice


#: Split-KV (decoding): at least this many keys per split, and at most this many splits.
MIN_KEYS_PER_SPLIT = 512
MAX_SPLITS = 64


def choose_splits(asked: int, jobs: int, longest: int, threads: int, block_k: int) -> int:
    """How many key ranges each (sequence, head, query rows) job is split into.

    ``asked`` 0: enough splits that the ``jobs`` (sequences x heads x query-row jobs) give
    every thread about 4 jobs, each split keeping at least :data:`MIN_KEYS_PER_SPLIT` keys,
    at most :data:`MAX_SPLITS`; a batch that already fills the threads is not split.
    Otherwise ``asked``, capped at the number of key tiles (more splits would be empty).
    """
    tiles = max(1, -(-longest // block_k))
    if asked:
        return max(1, min(asked, tiles))
    want = -(-4 * max(threads, 1) // max(jobs, 1))
    return max(1, min(want, longest // MIN_KEYS_PER_SPLIT, MAX_SPLITS, tiles))


#: Longest key tile of the KV-cache forward (decoding): few query rows make each product
#: small, so longer key tiles cut the per-tile overhead.
MAX_DECODE_BLOCK_K = 512


def decode_tiles(seqlen_q: int, head_dim: int, base: TileConfig, longest: int,
                 splits_asked: int, *, dtype: str) -> tuple[int, int]:
    """(block_q, block_k) of the KV-cache forward on the masked kernels (more query rows
    than decode_kernels take): query tiles no taller than the queries (a power of two >=
    Nq, at least the products' row block PRODUCT_ROWS) but a whole number of the
    products' column blocks for ``dtype`` (the masked forward computes S^T, queries
    across its columns: a shorter tile had its products write past the score tile), key
    tiles as long as the single-thread BLAS bound allows, up to MAX_DECODE_BLOCK_K, and
    short enough (down to 16) that an explicit split count finds that many key tiles
    (splits are runs of whole tiles)."""
    cols = column_block(dtype)
    block_q = min(base.block_q, max(PRODUCT_ROWS, 1 << max(0, int(seqlen_q) - 1).bit_length()))
    block_q = -(-block_q // cols) * cols
    block_k = base.block_k
    while (block_k * 2 <= MAX_DECODE_BLOCK_K
           and block_q * block_k * 2 * head_dim <= BLAS_SINGLE_THREAD_MNK):
        block_k *= 2
    while splits_asked > 1 and block_k > 16 and -(-longest // block_k) < splits_asked:
        block_k //= 2
    return block_q, block_k


@dataclass(frozen=True)
class ProductTiles:
    """Tiles of the dense kernels, whose products are written in SIMD registers
    (products.py) instead of BLAS calls: rows a multiple of products.ROWS, key tiles and
    the padded head dim ``d_pad`` multiples of the products' column block (two vectors);
    the forward's query tiles too, since its score tiles are transposed (queries across)."""

    block_q: int
    block_k: int
    bwd_block_q: int
    bwd_block_k: int
    d_pad: int


#: item size of the compute dtype per input dtype (float16/bfloat16 compute in float32)
_WORK_ITEMSIZE = {"float16": 4, "bfloat16": 4, "float32": 4, "float64": 8}


def column_block(dtype: str) -> int:
    """The products' column block for inputs of ``dtype``: two vectors of the compute
    dtype on this host (products.py)."""
    return 2 * lanes(_WORK_ITEMSIZE[dtype])


@functools.cache
def product_tiles(head_dim: int, dtype: str) -> ProductTiles:
    col_block = column_block(dtype)
    d_pad = -(-max(head_dim, 1) // col_block) * col_block
    block_k = max(64, col_block)
    return ProductTiles(max(32, col_block), block_k, 64, block_k, d_pad)
