"""Context parallelism: exact ring attention over a sharded sequence.

On ``torch.distributed`` (NCCL on GPUs, gloo on CPUs), every rank calls with its local
shard of the sequence axis::

    import flashcore.distributed as fcd
    q, k, v = (fcd.shard_sequence(x, balanced=True) for x in (q_full, k_full, v_full))
    o = fcd.ring_attention(q, k, v, causal=True)          # this rank's rows of o
    o_full = fcd.gather_sequence(o)

In JAX, inside ``shard_map`` with the sequence axis sharded over mesh axis ``axis_name``::

    o = fcd.ring_attention(q, k, v, axis_name="sp", causal=True)

``balanced=True`` is the load-balanced ("zigzag") order for causal attention: the sequence
is cut into 2W chunks and rank r holds chunks r and 2W-1-r; ``balanced=False`` is
contiguous order. Chunks hold ``ceil(N / chunks)`` tokens except the last ones, which hold
the rest (fewer, or none). :func:`shard_sequence` and :func:`gather_sequence` (torch) and
:func:`sequence_order` (any library: the permutation to apply before sharding a JAX array
into equal contiguous pieces) make and undo that order. Results equal single-device
:func:`flashcore.attention` on the whole sequence; both frameworks differentiate through it.
Communication is the frameworks' own (``batch_isend_irecv``, ``lax.ppermute``).
"""
from __future__ import annotations

from ._chunks import order as _order


def _is_torch(x):
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def ring_attention(q, k, v, *, group=None, axis_name=None, causal=False, scale=None,
                   layout="bhnd", balanced=True, return_lse=False, backend="auto"):
    """This rank's (or this shard's) rows of ``attention(q, k, v)`` over the whole sequence;
    ``(o, lse)`` with ``return_lse``. torch: ``group`` (default: the world); JAX:
    ``axis_name``, the mesh axis of the sequence, inside ``shard_map``."""
    if axis_name is not None:
        from ._jax_ring import ring_attention as jax_ring

        if group is not None:
            raise TypeError("pass group (torch) or axis_name (JAX), not both")
        return jax_ring(q, k, v, axis_name=axis_name, causal=causal, scale=scale,
                        layout=layout, balanced=balanced, return_lse=return_lse,
                        backend=backend)
    if not _is_torch(q):
        raise TypeError("ring_attention takes torch tensors (with group) or, inside "
                        "jax shard_map, JAX arrays with axis_name; got "
                        f"{type(q).__module__}.{type(q).__qualname__} without axis_name")
    from ._torch_ring import ring_attention as torch_ring

    return torch_ring(q, k, v, group=group, causal=causal, scale=scale, layout=layout,
                      balanced=balanced, return_lse=return_lse, backend=backend)


def shard_sequence(x, *, group=None, layout="bhnd", balanced=True):
    """This rank's part of the full sequence ``x`` (every rank passes the same x)."""
    from ._torch_ring import shard_sequence as shard

    return shard(x, group=group, layout=layout, balanced=balanced)


def gather_sequence(x_local, *, group=None, layout="bhnd", balanced=True):
    """The full sequence from every rank's part, on every rank (undoes shard_sequence)."""
    from ._torch_ring import gather_sequence as gather

    return gather(x_local, group=group, layout=layout, balanced=balanced)


def sequence_order(n: int, world: int, *, balanced: bool = True) -> list[int]:
    """Token indices in shard order: ``x[..., sequence_order(N, W), :]`` laid out this way
    and cut into W contiguous pieces gives each rank its shard (for JAX's ``shard_map``,
    which shards by equal contiguous pieces: then N must be divisible by W, or by 2W when
    balanced). ``argsort`` of it undoes it."""
    return _order(n, world, balanced)
