"""Ring attention on ``torch.distributed`` (NCCL on GPUs, gloo on CPUs).

Every rank holds a shard of q, k, v along the sequence (``_chunks`` says which tokens).
The forward pass runs W steps: at step s rank r computes its queries against the key/value
block of rank ``(r - s) mod W`` with flashcore's kernels, merges the partial output by
log-sum-exp, and meanwhile receives the next block (``batch_isend_irecv``, so the transfer
overlaps the kernel). The backward pass is a second ring: each key/value block travels with
its dK/dV partial sums (in the inputs' dtype, see ``ring_backward``) that every rank adds
its contribution to (the kernels take the global lse, so each block's P is the global
one), and one last hop brings them home.

Memory per rank, in units of one local shard of q (X): the forward holds o's float32
accumulator (2X), the next K/V block in flight (2X) and one step's output (X); the backward
the float32 dq (2X), the next K/V block (2X), the travelling dK/dV and their receive
buffers (2X + 2X, the receive ones allocated after the step's kernel outputs (3X) are
freed or handed on). Temporaries of o's size are avoided (in-place merges).

Which part of a step's block a rank computes (``_step``): with ``causal``, in contiguous
order a block from an earlier rank is seen whole, the rank's own block is causal and a
later rank's block is skipped; in balanced order the own block is causal, a block from an
earlier rank is seen whole by all queries but only through its first chunk, and a later
rank's block whole but only by the second query chunk. Every step is then a dense or a
causal (Nq = Nk) call of the kernels, and the skipped parts cost nothing.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import flashcore

from . import _chunks


def _seq_axis(layout):
    return 2 if layout == "bhnd" else 1


def _world(group):
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("flashcore.distributed needs torch.distributed initialized "
                           "(dist.init_process_group, e.g. under torchrun)")
    return dist.get_world_size(group), dist.get_rank(group)


def _peer(group, rank):
    return rank if group is None else dist.get_global_rank(group, rank)


# --- checks: every rank learns every rank's facts, so all raise together -----------------


def _local_problem(q, k, v, layout, balanced):
    """This rank's facts, or the reason its inputs are wrong."""
    if layout not in ("bhnd", "bnhd"):
        return {"error": f"layout={layout!r} is not one of ('bhnd', 'bnhd')"}
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or x.ndim != 4:
            return {"error": f"{name} must be a 4-d torch tensor"}
    ax = _seq_axis(layout)
    if q.shape[ax] != k.shape[ax]:
        return {"error": f"ring attention is self-attention over one sequence: q and k must "
                         f"hold the same tokens; got {q.shape[ax]} and {k.shape[ax]} here"}
    if k.shape != v.shape:
        return {"error": f"k and v must have one shape; got {tuple(k.shape)} and "
                         f"{tuple(v.shape)}"}
    if len({q.device, k.device, v.device}) > 1:
        return {"error": f"q, k and v must be on one device; got {q.device}, {k.device}, "
                         f"{v.device}"}
    other = [d for i, d in enumerate(q.shape) if i != ax]
    kother = [d for i, d in enumerate(k.shape) if i != ax]
    return {"error": None, "n": int(q.shape[ax]), "q": other, "kv": kother,
            "dtype": str(q.dtype), "device_type": q.device.type, "balanced": bool(balanced)}


def _agree(group, facts):
    """All ranks' facts; raises the same ValueError on every rank when any is wrong."""
    world, rank = _world(group)
    everyone = [None] * world
    dist.all_gather_object(everyone, facts, group=group)
    for r, f in enumerate(everyone):
        if f["error"] is not None:
            raise ValueError(f"ring attention, rank {r}: {f['error']}")
    ref = everyone[0]
    for key in ("q", "kv", "dtype", "device_type", "balanced"):
        seen = [f[key] for f in everyone]
        if any(s != ref[key] for s in seen):
            raise ValueError(f"ring attention: the ranks disagree on {key} (all but the "
                             f"sequence axis must match): {seen}")
    lengths = [f["n"] for f in everyone]
    total = sum(lengths)
    if total < world:
        raise ValueError(f"ring attention: a sequence of {total} tokens is shorter than "
                         f"the world size {world}")
    want = [_chunks.local_length(total, world, r, ref["balanced"]) for r in range(world)]
    if lengths != want:
        raise ValueError(f"ring attention: the ranks hold {lengths} tokens; a sequence of "
                         f"{total} sharded by shard_sequence(balanced={ref['balanced']}) "
                         f"holds {want}")
    return lengths


# --- one step ----------------------------------------------------------------------------


def _step(rank, src, causal, balanced, n_q, n_k, pieces_q, pieces_k):
    """``(q rows, key rows, causal)`` of rank ``rank``'s queries against rank ``src``'s
    block (slices along the local sequence), or None where nothing is seen."""
    whole_q, whole_k = slice(0, n_q), slice(0, n_k)
    if not causal:
        return whole_q, whole_k, False
    if src == rank:
        return whole_q, whole_k, True
    if not balanced:
        return (whole_q, whole_k, False) if src < rank else None
    if src < rank:  # their first chunk precedes both of ours; their second follows both
        first = pieces_k[0][1] - pieces_k[0][0]
        return (whole_q, slice(0, first), False) if first else None
    first = pieces_q[0][1] - pieces_q[0][0]  # only our second chunk sees them
    return (slice(first, n_q), whole_k, False) if first < n_q else None


def _narrow(x, ax, s):
    return x.narrow(ax, s.start, s.stop - s.start)


def _bhnd(x, layout):
    return x if layout == "bhnd" else x.transpose(1, 2)


def _merge(o_acc, lse_acc, o_b, lse_b):
    """Fold a block's (o, lse) into the running ones, in place and without temporaries of
    o's size (o_acc in the accumulator dtype (_acc), bhnd views)."""
    new = torch.logaddexp(lse_acc, lse_b)
    empty = torch.isneginf(new)
    safe = torch.where(empty, torch.zeros_like(new), new)
    w_old = torch.where(empty, torch.zeros_like(new), torch.exp(lse_acc - safe))
    w_new = torch.where(empty, torch.zeros_like(new), torch.exp(lse_b - safe))
    o_acc.mul_(w_old.unsqueeze(-1)).addcmul_(o_b, w_new.unsqueeze(-1))
    lse_acc.copy_(new)


class _Ring:
    """The ring's neighbours and the sizes of the blocks that travel it."""

    def __init__(self, group, lengths, balanced):
        self.group = group
        self.world, self.rank = _world(group)
        self.lengths = lengths
        self.total = sum(lengths)
        self.balanced = balanced
        self.next = _peer(group, (self.rank + 1) % self.world)
        self.prev = _peer(group, (self.rank - 1) % self.world)

    def src(self, step):
        return (self.rank - step) % self.world

    def pieces(self, r):
        return _chunks.rank_pieces(self.total, self.world, r, self.balanced)

    def start(self, send, recv_like_n, ax):
        """Send ``send`` tensors on, receive the previous rank's (``recv_like_n`` tokens
        along ``ax``); returns (requests, received tensors)."""
        recv = []
        for t in send:
            shape = list(t.shape)
            shape[ax] = recv_like_n
            recv.append(torch.empty(shape, dtype=t.dtype, device=t.device))
        ops = [dist.P2POp(dist.isend, t.contiguous(), self.next, self.group) for t in send]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return dist.batch_isend_irecv(ops), recv


def _wait(reqs):
    for r in reqs:
        r.wait()


def _acc(x):
    """The dtype the ring accumulates o, lse and the gradients in: float64 for float64
    inputs (as the kernels' lse), float32 otherwise."""
    return torch.promote_types(x.dtype, torch.float32)


def ring_forward(q, k, v, ring, causal, scale, layout, backend):
    ax = _seq_axis(layout)
    B, Hq, n, D = _bhnd(q, layout).shape
    o_acc = torch.zeros((B, Hq, n, D), dtype=_acc(q), device=q.device)
    lse_acc = torch.full((B, Hq, n), -torch.inf, dtype=_acc(q), device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    for s in range(ring.world):
        src = ring.src(s)
        reqs = []
        if s < ring.world - 1:
            reqs, (k_next, v_next) = ring.start((k_cur, v_cur), ring.lengths[ring.src(s + 1)],
                                                ax)
        part = _step(ring.rank, src, causal, ring.balanced, n, k_cur.shape[ax],
                     ring.pieces(ring.rank), ring.pieces(src))
        if part is not None:
            rows, cols, c = part
            o_b, lse_b = flashcore.attention_forward(
                _narrow(q, ax, rows), _narrow(k_cur, ax, cols), _narrow(v_cur, ax, cols),
                causal=c, scale=scale, layout=layout, backend=backend)
            _merge(o_acc[:, :, rows], lse_acc[:, :, rows], _bhnd(o_b, layout), lse_b)
            del o_b, lse_b  # before the next step's kernel allocates its own
        _wait(reqs)
        if reqs:
            k_cur, v_cur = k_next, v_next
    o = o_acc.to(q.dtype)
    return (o if layout == "bhnd" else o.transpose(1, 2).contiguous()), lse_acc


def ring_backward(do, q, k, v, o, lse, ring, causal, scale, layout, backend):
    """The second ring. dq accumulates here in _acc's dtype; a block's dK/dV travel with it
    in the inputs' dtype, each rank adding its part in place (``add_`` rounds the float32
    sum once), and the last hop brings them home. With two ranks that is bit for bit a
    float32 accumulator rounded at the end; each further rank adds one rounding of the
    partial sum (float32 and float64 inputs travel in their own dtype: no rounding)."""
    ax = _seq_axis(layout)
    n = q.shape[ax]
    dq = torch.zeros(q.shape, dtype=_acc(q), device=q.device)
    k_cur, v_cur = k.contiguous(), v.contiguous()
    dk_cur = dv_cur = None  # the travelling sums of the block in hand
    do = do.contiguous()
    for s in range(ring.world):
        src = ring.src(s)
        reqs = []
        if s < ring.world - 1:
            reqs, (k_next, v_next) = ring.start((k_cur, v_cur), ring.lengths[ring.src(s + 1)],
                                                ax)
        part = _step(ring.rank, src, causal, ring.balanced, n, k_cur.shape[ax],
                     ring.pieces(ring.rank), ring.pieces(src))
        if part is not None:
            rows, cols, c = part
            dq_b, dk_b, dv_b = flashcore.attention_backward(
                _narrow(do, ax, rows), _narrow(q, ax, rows), _narrow(k_cur, ax, cols),
                _narrow(v_cur, ax, cols), _narrow(o, ax, rows), lse[:, :, rows].contiguous(),
                causal=c, scale=scale, layout=layout, backend=backend)
            _narrow(dq, ax, rows).add_(dq_b)
            del dq_b
            if dk_cur is None and cols.stop - cols.start == k_cur.shape[ax]:
                dk_cur, dv_cur = dk_b.contiguous(), dv_b.contiguous()  # no copy: the kernels'
            else:
                if dk_cur is None:
                    dk_cur, dv_cur = torch.zeros_like(k_cur), torch.zeros_like(v_cur)
                _narrow(dk_cur, ax, cols).add_(dk_b)
                _narrow(dv_cur, ax, cols).add_(dv_b)
            del dk_b, dv_b
        elif dk_cur is None:
            dk_cur, dv_cur = torch.zeros_like(k_cur), torch.zeros_like(v_cur)
        # This block's dK/dV move on with it (the last hop brings ours home); the K/V
        # block for the next step is already in flight.
        dreqs, (dk_next, dv_next) = ring.start((dk_cur, dv_cur),
                                               ring.lengths[ring.src(s + 1)], ax)
        _wait(reqs)
        _wait(dreqs)
        if reqs:
            k_cur, v_cur = k_next, v_next
        dk_cur, dv_cur = dk_next, dv_next
    return dq.to(q.dtype), dk_cur, dv_cur


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, causal, scale, layout, backend):
        o, lse = ring_forward(q, k, v, ring, causal, scale, layout, backend)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (ring, causal, scale, layout, backend)
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, _dlse):
        q, k, v, o, lse = ctx.saved_tensors
        grads = ring_backward(do, q, k, v, o, lse, *ctx.args)
        return (*grads, None, None, None, None, None)


def ring_attention(q, k, v, *, group=None, causal=False, scale=None, layout="bhnd",
                   balanced=True, return_lse=False, backend="auto"):
    lengths = _agree(group, _local_problem(q, k, v, layout, balanced))
    ring = _Ring(group, lengths, balanced)
    o, lse = RingAttention.apply(q, k, v, ring, causal, scale, layout, backend)
    return (o, lse) if return_lse else o


# --- sharding ------------------------------------------------------------------------------


def shard_sequence(x, *, group=None, layout="bhnd", balanced=True):
    world, rank = _world(group)
    ax = _seq_axis(layout)
    n = x.shape[ax]
    if n < world:
        raise ValueError(f"a sequence of {n} tokens is shorter than the world size {world}")
    parts = [x.narrow(ax, a, b - a) for a, b in _chunks.rank_pieces(n, world, rank, balanced)]
    return torch.cat(parts, dim=ax)


def gather_sequence(x_local, *, group=None, layout="bhnd", balanced=True):
    world, rank = _world(group)
    ax = _seq_axis(layout)
    n_local = torch.tensor([x_local.shape[ax]], dtype=torch.int64, device=x_local.device)
    counts = [torch.zeros_like(n_local) for _ in range(world)]
    dist.all_gather(counts, n_local, group=group)
    counts = [int(c.item()) for c in counts]
    total, most = sum(counts), max(counts)
    shape = list(x_local.shape)
    shape[ax] = most
    padded = torch.zeros(shape, dtype=x_local.dtype, device=x_local.device)
    padded.narrow(ax, 0, counts[rank]).copy_(x_local)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded, group=group)
    shape[ax] = total
    full = torch.empty(shape, dtype=x_local.dtype, device=x_local.device)
    for r in range(world):
        at = 0
        for a, b in _chunks.rank_pieces(total, world, r, balanced):
            full.narrow(ax, a, b - a).copy_(parts[r].narrow(ax, at, b - a))
            at += b - a
    return full
