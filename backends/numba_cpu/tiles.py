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

#: OpenBLAS's single-thread bound on M*N*K for one GEMM (SMP_THRESHOLD_MIN * 4).
BLAS_SINGLE_THREAD_MNK = 65536 * 4

#: Candidate (block_q, block_k) pairs, best first.
CANDIDATES = ((128, 128), (128, 64), (64, 64), (64, 32), (32, 32), (32, 16), (16, 16))


@dataclass(frozen=True)
class TileConfig:
    block_q: int
    block_k: int

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"tile sizes must be positive; got {self}")


@functools.cache
def choose_tiles(head_dim: int, dtype: str, causal: bool) -> TileConfig:
    """The largest candidate tiles whose products stay single-threaded in BLAS."""
    for bq, bk in CANDIDATES:
        if bq * bk * head_dim <= BLAS_SINGLE_THREAD_MNK:
            return TileConfig(bq, bk)
    return TileConfig(*CANDIDATES[-1])


#: Query tiles one forward job may own (each key/value tile it loads serves all of them).
MAX_Q_TILES_PER_JOB = 4


def q_tiles_per_job(n_tiles: int, threads: int) -> int:
    """As many query tiles per job as keeps at least 4 jobs per thread (load balance)."""
    per = n_tiles // (4 * max(threads, 1))
    return max(1, min(MAX_Q_TILES_PER_JOB, per))
