"""How a sequence of N tokens is cut among W ranks (pure arithmetic, no framework).

Contiguous order (``balanced=False``): W chunks, rank r holds chunk r. Balanced ("zigzag")
order (``balanced=True``): 2W chunks, rank r holds chunks r and 2W-1-r, so under a causal
mask every rank has the same work (an early chunk, whose queries see little, with a late
one, whose queries see much). Chunks hold ``ceil(N / chunks)`` tokens each, except the last
ones, which hold what is left (fewer, or none): for N = 10 and W = 4 balanced, chunks of
2, 2, 2, 2, 2, 0, 0, 0 tokens, so rank 3 holds chunks 3 and 4 (4 tokens), rank 0 chunks 0
and 7 (2 tokens).
"""
from __future__ import annotations


def chunk_bounds(n: int, chunks: int) -> list[tuple[int, int]]:
    """``[(start, stop), ...]`` of ``chunks`` chunks of ``ceil(n / chunks)`` tokens (the
    last ones shorter or empty)."""
    size = -(-n // chunks) if chunks else 0
    return [(min(n, c * size), min(n, (c + 1) * size)) for c in range(chunks)]


def rank_pieces(n: int, world: int, rank: int, balanced: bool) -> list[tuple[int, int]]:
    """The token ranges rank ``rank`` holds, in the order its local shard keeps them."""
    if not balanced:
        return [chunk_bounds(n, world)[rank]]
    bounds = chunk_bounds(n, 2 * world)
    return [bounds[rank], bounds[2 * world - 1 - rank]]


def local_length(n: int, world: int, rank: int, balanced: bool) -> int:
    return sum(b - a for a, b in rank_pieces(n, world, rank, balanced))


def order(n: int, world: int, balanced: bool) -> list[int]:
    """The token order of the shards laid end to end (rank 0's, then rank 1's, ...): the
    permutation that makes a sequence shardable by equal contiguous slices."""
    out = []
    for r in range(world):
        for a, b in rank_pieces(n, world, r, balanced):
            out.extend(range(a, b))
    return out
