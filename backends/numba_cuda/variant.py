"""Kernel variants as data: one frozen description of what one compiled kernel computes.

A :class:`Variant` names the kernel (a step of the algorithm: forward, backward
preprocess, dK/dV pass, dQ pass), its family (CUDA-core ``simt`` or ``tensor_core``), the
head dim and dtype it is specialized for, the mask it applies, its tiling and how its
tiles reach shared memory. Everything else follows from it: the kernel factories build
the Python kernel from it (``launch.build``), the compiled kernel is cached under it
(together with the device), its name in profiles and numba's disk cache is
:attr:`Variant.tag`, its shared memory and threads are derived here, and the precompile
list and the PTX tests enumerate variants (``launch.case_variants``).

Adding an axis (a window, a score modifier, varlen bounds, a paged cache) adds a field
here and the code that reads it in the two seams (``device/seams.py``); the factories
pass the variant through unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import tilings

#: kernel -> name of its entry point (and of the launch signature, launch.signature)
ENTRY = {"forward": "attn_forward", "preprocess": "attn_backward_preprocess",
         "dkdv": "attn_backward_dkdv", "dq": "attn_backward_dq",
         "dkdvq": "attn_backward_dkdvq", "dqconvert": "attn_backward_dq_convert",
         "merge": "attn_merge_splits", "append": "cache_append",
         "classify": "tile_classify"}
#: Kernels whose ``tiles`` is a thread count: one thread per row or element, no tiling.
ELEMENTWISE = ("preprocess", "merge", "append", "dqconvert", "classify")
#: Row layouts (Variant.packed): a dense batch, packed variable-length sequences, a
#: contiguous KV cache, a paged KV cache.
PACKINGS = ("", "varlen", "cache", "paged")
FAMILIES = ("simt", "tensor_core", "hopper")


@dataclass(frozen=True)
class UserMods:
    """The user's ``score_mod`` and ``mask_mod`` (either may be None) and the kind of each
    ``mod_args`` array, ``(dtype name, ndim)``: what a kernel compiles them for
    (``device/user_mods.py``). Functions compare by identity."""

    score_mod: object = None
    mask_mod: object = None
    args: tuple = ()

    @property
    def label(self) -> str:
        """The functions' names, for kernel names and profiles."""
        def name(f):
            n = getattr(getattr(f, "py_func", f), "__name__", "fn")
            return "".join(c if c.isalnum() else "_" for c in n)
        parts = []
        if self.score_mod is not None:
            parts.append("sm_" + name(self.score_mod))
        if self.mask_mod is not None:
            parts.append("mm_" + name(self.mask_mod))
        return "_".join(parts) + f"_a{len(self.args)}"


@dataclass(frozen=True)
class Variant:
    """One compiled kernel.

    ``tiles`` is a :class:`tilings.Tiles` (simt), a :class:`tilings.TCTiles`
    (tensor_core), a :class:`tilings.HopperTiles` (hopper: the sm_90a wgmma forward and
    backward), a :class:`tilings.RowTiles` (the preprocess), or the thread count of the
    other elementwise kernels. ``streamed`` (simt fp32 only): K and V (forward, dQ) or Q
    and dO (dK/dV) arrive by 16-byte ``cp.async`` copies and are stored as rows
    (``tilings.streams``).
    """

    kernel: str
    family: str
    head_dim: int
    dtype: str
    causal: bool
    tiles: object
    streamed: bool = False
    #: Sliding window (left, right), each >= 0 or -1 for an unbounded side; () for none.
    window: tuple = ()
    #: Logit softcap c (s -> c tanh(s / c) on the scaled score); 0.0 for none.
    softcap: float = 0.0
    #: ALiBi: the kernel adds -slope[b, h] |i' - j| to each score (slopes a launch argument).
    alibi: bool = False
    #: The user's score_mod / mask_mod (a :class:`UserMods`), or None. Such variants are
    #: compiled in each process (numba's disk cache keys a kernel by its name and source,
    #: which cannot tell two user functions, or two values they close over, apart).
    user: object = None
    #: Row layout (:data:`PACKINGS`): "" a dense batch; "varlen" packed sequences, each
    #: batch entry's rows read from the offsets; "cache"/"paged" a KV cache whose keys per
    #: sequence are a launch argument, "paged" read through a block table.
    packed: str = ""
    #: Split-KV (forward of a KV cache): each block computes one range of keys and writes
    #: a float32 partial output and lse, which the "merge" kernel combines.
    split: bool = False

    def __post_init__(self):
        if self.kernel not in ENTRY:
            raise ValueError(f"kernel={self.kernel!r} is not one of {tuple(ENTRY)}")
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not one of {FAMILIES}")
        if self.family == "tensor_core" and self.kernel in ELEMENTWISE:
            raise ValueError(f"the {self.kernel} kernel has no tensor-core form")
        if self.family == "hopper" and self.kernel not in ("forward", "dkdv", "dq", "dkdvq"):
            raise ValueError(f"the {self.kernel} kernel has no wgmma (hopper) form")
        if self.packed not in PACKINGS:
            raise ValueError(f"packed={self.packed!r} is not one of {PACKINGS}")

    @property
    def bounds(self) -> tuple:
        """``(LEFT, RIGHT)`` as the kernels take them: -1 for an unbounded side."""
        return tuple(self.window) if self.window else (-1, -1)

    @property
    def entry(self) -> str:
        return ENTRY[self.kernel]

    @property
    def threads(self) -> int:
        return self.tiles if isinstance(self.tiles, int) else self.tiles.threads

    @property
    def block_m(self) -> int:
        """Rows a block owns: queries (forward, dQ), keys (dK/dV), queries (preprocess)."""
        return self.tiles if isinstance(self.tiles, int) else self.tiles.block_m

    @property
    def launch_bounds(self):
        """numba's ``launch_bounds`` (SIMT and wgmma tilings that cap registers), or None."""
        if self.family in ("simt", "hopper") and self.kernel not in ELEMENTWISE:
            return self.tiles.launch_bounds
        return None

    @property
    def smem_words(self) -> int:
        """Dynamic shared memory in 4-byte words."""
        if self.kernel in ELEMENTWISE:
            return 0
        if self.family == "hopper":
            return tilings.hopper_smem_bytes(self.tiles, self.head_dim, self.kernel) // 4
        if self.family == "tensor_core":
            return tilings.smem_elements(self.kernel, self.tiles, self.head_dim) // 2
        layout = {"forward": tilings.forward_layout, "dkdv": tilings.dkdv_layout,
                  "dq": tilings.dq_layout}[self.kernel]
        return layout(self.tiles, self.head_dim, self.streamed)["words"]

    @property
    def tag(self) -> str:
        """The kernel's qualified name: numba's disk cache keeps one index file per name,
        so variants compiled by different processes never overwrite each other's entry,
        and profiles name the variant."""
        d, t = self.head_dim, self.tiles
        mask = "causal" if self.causal else "full"
        if self.window:
            mask += "_w{}_{}".format(*(("n" if w < 0 else w) for w in self.window))
        if self.softcap:
            mask += "_sc" + format(self.softcap, "g").replace(".", "p").replace("-", "m")
        if self.alibi:
            mask += "_alibi"
        if self.user is not None:
            mask += "_" + self.user.label
        if self.packed:
            mask += "_" + self.packed
        if self.split:
            mask += "_split"
        if self.kernel == "preprocess":
            return f"{self.entry}_d{d}_{t.tag}_{self.dtype}"
        if self.kernel in ELEMENTWISE:
            return f"{self.entry}_{self.packed or 'dense'}_t{t}_{self.dtype}"
        if self.family == "hopper":
            return f"{self.entry}_wgmma_d{d}_{t.tag}_{mask}_{self.dtype}"
        if self.family == "tensor_core":
            return f"{self.entry}_tc_d{d}_{t.tag}_{mask}_{self.dtype}"
        tag = f"d{d}_{t.block_m}x{t.block_n}_{t.rows}x{t.cols}"
        if t.min_blocks > 1:
            tag += f"_b{t.min_blocks}"
        if self.streamed:
            tag += "_cpa"
        if t.one_ps_buffer:
            tag += "_ps1"
        if t.k_unroll:
            tag += f"_u{t.k_unroll}"
        return f"{self.entry}_{tag}_{mask}"
