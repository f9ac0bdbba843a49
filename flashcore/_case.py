"""The description of one attention call that every backend is asked about.

The front end builds a :class:`Case` after checking the arguments; backends answer
``supports(case)`` from it and read sizes and options from it when they launch.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from . import _rules

#: dtypes flashcore computes on, by name.
DTYPES = ("float16", "bfloat16", "float32", "float64")
LAYOUTS = ("bhnd", "bnhd")


@dataclass(frozen=True)
class Varlen:
    """Packed variable-length sequences (``flashcore.attention_varlen``).

    q is ``(total_q, Hq, D)``, k and v ``(total_k, Hkv, D)``: token-major, like layout
    ``"bnhd"`` without the batch axis. Sequence ``s`` owns query rows
    ``cu_seqlens_q[s] : cu_seqlens_q[s + 1]`` and key rows
    ``cu_seqlens_k[s] : cu_seqlens_k[s + 1]``, and is attended on its own with every rule of
    dense attention (bottom-right causal with ``offset = n_k(s) - n_q(s)``, GQA, rows that
    see no key give 0 and lse -inf). lse is ``(Hq, total_q)``.

    On the :class:`Case`: ``batch`` is the number of sequences, ``seqlen_q``/``seqlen_k`` are
    ``max_seqlen_q``/``max_seqlen_k`` (every sequence fits: checked on the host), ``layout``
    is ``"bnhd"``. A grid of jobs sized ``(batch, heads, ceil(max_seqlen / tile))`` covers
    every sequence, and jobs past a sequence's end do nothing (the CPU's); the GPU's grid
    counts each sequence's tiles instead (``device/seams.packed_tile``). Mods see ``b`` = the sequence
    index and ``i``, ``j`` = positions within the sequence.
    """

    total_q: int
    total_k: int
    # The offsets themselves, int32 (or int64) 1-D of length batch + 1 in the caller's
    # library and device: per call, not part of the case's identity.
    cu_seqlens_q: object = field(default=None, compare=False, hash=False, repr=False)
    cu_seqlens_k: object = field(default=None, compare=False, hash=False, repr=False)


@dataclass(frozen=True)
class KVCache:
    """Attention of new query rows against a key/value cache (``attention_with_kvcache``).

    q is ``(B, Nq, Hq, D)`` (layout ``"bnhd"``). The cache is contiguous,
    ``(B, capacity, Hkv, D)``, or paged, ``(num_pages, page_size, Hkv, D)`` with
    ``block_table`` int32 ``(B, pages_per_seq)``: key position ``p`` of sequence ``b`` is
    slot ``p % page_size`` of page ``block_table[b, p // page_size]``. Sequence ``b`` has
    ``cache_seqlens[b]`` cached keys; when new keys are given (``n_new > 0``:
    ``k_new``/``v_new`` ``(B, n_new, Hkv, D)``) a backend first writes them **in place** at
    positions ``cache_seqlens[b] ... + n_new - 1`` (through the block table when paged), then
    attends all ``cache_seqlens[b] + n_new`` keys, with the query rows aligned to the end
    (bottom-right causal, ``offset = cache_seqlens[b] + n_new - Nq``). lse is
    ``(B, Hq, Nq)``. Forward only.

    On the :class:`Case`: ``seqlen_q`` is Nq, ``seqlen_k`` is a sequence's capacity in keys
    (``capacity``, or ``pages_per_seq * page_size``), ``layout`` is ``"bnhd"``. The front
    end has checked every value (lengths within capacity, pages inside the pool) before a
    backend is called, so nothing is written on a rejected call.
    """

    paged: bool
    page_size: int  # keys per page; the capacity for a contiguous cache
    num_pages: int  # pages in the pool; B for a contiguous cache
    pages_per_seq: int  # block_table's width; 1 for a contiguous cache
    n_new: int  # new keys appended per sequence (0: none given)
    num_splits: int  # split-KV count asked: 0 = the backend's heuristic, 1 = no split
    # Per call, not part of the case's identity: int32 (B,) cached lengths before the
    # append; int32 (B, pages_per_seq) or None; the new keys and values or None.
    cache_seqlens: object = field(default=None, compare=False, hash=False, repr=False)
    block_table: object = field(default=None, compare=False, hash=False, repr=False)
    k_new: object = field(default=None, compare=False, hash=False, repr=False)
    v_new: object = field(default=None, compare=False, hash=False, repr=False)
    #: The longest key range after the append, max(cache_seqlens + n_new), read on the host
    #: with the checks (split-KV heuristics need it; kernels read the lengths themselves).
    max_seqlen_k: int = field(default=0, compare=False, hash=False)


@dataclass(frozen=True)
class Case:
    """Sizes, dtype, options and origin of one call (hashable, so it can key caches).

    Shapes follow the layout: ``"bhnd"`` is q ``(B, Hq, Nq, D)`` and k, v
    ``(B, Hkv, Nk, D)``; ``"bnhd"`` is q ``(B, Nq, Hq, D)`` and k, v ``(B, Nk, Hkv, D)``.
    """

    library: str  # "numpy", "torch", "jax", "cupy", or another Array API namespace's name
    device: str  # "cpu" or "cuda:N"
    dtype: str  # one of DTYPES
    batch: int
    heads_q: int
    heads_kv: int
    seqlen_q: int
    seqlen_k: int
    head_dim: int
    causal: bool
    scale: float
    layout: str
    direction: str = "forward"  # "forward" or "backward"
    need_lse: bool = False  # forward only: whether the caller wants lse back
    explicit: bool = False  # the caller named the backend (so it may copy host<->device, or be slow)
    mods: object = None  # flashcore._mods.Mods: masks and score modifiers (None: plain)
    # The arrays the mods read, this call's own (not part of the case's identity).
    alibi_slopes: object = field(default=None, compare=False, hash=False, repr=False)
    mod_args: tuple = field(default=(), compare=False, hash=False, repr=False)
    varlen: Varlen | None = None  # packed variable-length sequences (None: a dense batch)
    kvcache: KVCache | None = None  # attention over a key/value cache (None: k, v given whole)

    @property
    def group(self) -> int:
        """Query heads per key/value head (1 for plain multi-head attention)."""
        return self.heads_q // self.heads_kv

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def causal_offset(self) -> int:
        """Bottom-right alignment: query ``i`` sees key ``j`` iff ``j <= i + causal_offset``."""
        return _rules.causal_offset(self.seqlen_q, self.seqlen_k)

    @property
    def packed(self) -> bool:
        """Varlen or KV cache: a backend that serves neither must decline such a case."""
        return self.varlen is not None or self.kvcache is not None

    def flops(self) -> float:
        """Floating-point operations of the forward pass (two matmuls), halved when causal."""
        f = 4.0 * self.batch * self.heads_q * self.seqlen_q * self.seqlen_k * self.head_dim
        return f / 2 if self.causal else f


def evolve(obj, **changes):
    """A copy of the frozen dataclass ``obj`` (a :class:`Case`, :class:`KVCache`, ...) with
    ``changes``: what ``dataclasses.replace`` gives for these classes, whose ``__init__``
    only stores the fields, without running it (a tenth of the time; a decode step makes
    two per call)."""
    new = object.__new__(type(obj))
    fields = new.__dict__
    fields.update(obj.__dict__)
    if not fields.keys() >= changes.keys():
        raise TypeError(f"{type(obj).__name__} has no field {set(changes) - set(fields)}")
    fields.update(changes)
    return new
