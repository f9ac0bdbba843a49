"""Tile configurations of the CPU kernels, as data.

A query tile of ``block_q`` rows meets key/value tiles of ``block_k`` rows; each product is
one BLAS call, so tiles are large enough to amortize the call and small enough that a
job's working set (Q, K, V, S and the accumulator tiles) stays in the core's L2 cache.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class TileConfig:
    block_q: int
    block_k: int

    def __post_init__(self):
        if self.block_q < 1 or self.block_k < 1:
            raise ValueError(f"tile sizes must be positive; got {self}")


@functools.cache
def choose_tiles(head_dim: int, dtype: str, causal: bool) -> TileConfig:
    """Tiles for a head dim, compute dtype and mask (measured on a 2-core AVX-512 machine)."""
    if head_dim > 128:
        return TileConfig(block_q=64, block_k=128)
    return TileConfig(block_q=128, block_k=128)
