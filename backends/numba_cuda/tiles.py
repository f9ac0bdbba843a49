"""Tile configurations of the CUDA kernels: plain data, chosen per (head dim, dtype, causal,
compute capability).

Every kernel works on a ``block_m x block_n`` tile of the score matrix with a
``rows x cols`` grid of threads; thread ``(r, c)`` owns the score rows ``r + rows * a``
(``a < block_m // rows``) and columns ``c + cols * b`` (``b < block_n // cols``), and the
head-dim columns ``c + cols * t`` (``t < ceil(D / cols)``) of the output rows it owns.
Strided ownership keeps the lanes of a warp on consecutive shared-memory words (no bank
conflicts) and broadcasts the words that lanes share.

Shared memory holds fp32 tiles stored transposed, ``tile[d][row]``, each row of the
transposed tile padded by ``pad`` words so that column walks also hit distinct banks.
"""
from __future__ import annotations

from dataclasses import dataclass

#: Shared memory a block may use by default; more needs an opt-in attribute per kernel.
STATIC_SMEM_LIMIT = 48 * 1024


@dataclass(frozen=True)
class Tiles:
    """One kernel's tiling: ``block_m`` query rows x ``block_n`` key rows per step."""

    block_m: int
    block_n: int
    rows: int  # thread rows
    cols: int  # thread columns
    pad: int = 1

    def __post_init__(self):
        if self.block_m % self.rows or self.block_n % self.cols:
            raise ValueError(f"tiles must divide among threads: {self}")

    @property
    def threads(self) -> int:
        return self.rows * self.cols

    @property
    def rm(self) -> int:
        """Score rows per thread."""
        return self.block_m // self.rows

    @property
    def rn(self) -> int:
        """Score columns per thread."""
        return self.block_n // self.cols

    def dpad(self, head_dim: int) -> int:
        """Head dim rounded up to a multiple of ``cols`` (padded columns hold zeros)."""
        return -(-head_dim // self.cols) * self.cols


@dataclass(frozen=True)
class KernelTiles:
    """The tilings of the three passes, as chosen for one (head dim, dtype, causal, cc)."""

    forward: Tiles
    dkdv: Tiles  # block_m: key rows owned by a block; block_n: query rows per step
    dq: Tiles  # block_m: query rows owned by a block; block_n: key rows per step
    preprocess_threads: int = 128


# Shared memory in fp32 words for each kernel (see the kernels for the layout).
def forward_smem_words(t: Tiles, head_dim: int) -> int:
    dp = t.dpad(head_dim)
    return dp * (t.block_m + t.pad) + dp * (t.block_n + t.pad) + t.block_n * (
        t.block_m + t.pad) + t.block_m * t.cols


def dkdv_smem_words(t: Tiles, head_dim: int) -> int:
    dp = t.dpad(head_dim)
    # K, V (resident) + Q, dO (streamed) + P and dS + lse and delta of the query tile
    return 2 * dp * (t.block_m + t.pad) + 2 * dp * (t.block_n + t.pad) + 2 * t.block_n * (
        t.block_m + t.pad) + 2 * t.block_n


def dq_smem_words(t: Tiles, head_dim: int) -> int:
    dp = t.dpad(head_dim)
    # Q, dO (resident) + K, V (streamed) + dS
    return 2 * dp * (t.block_m + t.pad) + 2 * dp * (t.block_n + t.pad) + t.block_n * (
        t.block_m + t.pad)


#: Tiny tiles for the CUDA simulator, which runs every thread as a Python thread: they keep
#: several tiles, tails and diagonal tiles in play on the small shapes the tests use.
SIMULATOR = KernelTiles(
    forward=Tiles(block_m=4, block_n=8, rows=2, cols=4),
    dkdv=Tiles(block_m=8, block_n=4, rows=4, cols=2),
    dq=Tiles(block_m=4, block_n=8, rows=2, cols=4),
    preprocess_threads=8,
)


def choose(head_dim: int, dtype: str, causal: bool, cc: tuple, simulator: bool = False,
           override: KernelTiles | None = None) -> KernelTiles:
    """The tilings for one case. fp16/bf16 inputs are converted to fp32 when tiles are loaded,
    so the dtype does not change the shared-memory footprint; the head dim does."""
    if override is not None:
        return override
    if simulator:
        return SIMULATOR
    if head_dim <= 64:
        fwd = Tiles(block_m=64, block_n=64, rows=16, cols=16)
        dkdv = Tiles(block_m=64, block_n=64, rows=16, cols=16)
        dq = Tiles(block_m=64, block_n=64, rows=16, cols=16)
    elif head_dim <= 128:
        fwd = Tiles(block_m=64, block_n=64, rows=16, cols=16)
        dkdv = Tiles(block_m=64, block_n=32, rows=16, cols=16)
        dq = Tiles(block_m=64, block_n=32, rows=16, cols=16)
    else:
        fwd = Tiles(block_m=32, block_n=32, rows=8, cols=16)
        dkdv = Tiles(block_m=32, block_n=32, rows=8, cols=16)
        dq = Tiles(block_m=32, block_n=32, rows=8, cols=16)
    return KernelTiles(forward=fwd, dkdv=dkdv, dq=dq)
