"""Tilings of the Hopper (sm_90a, wgmma) kernels, as data: :class:`HopperTiles`, the tables
per (head dim, causal) of the forward, dK/dV and dQ kernels, the candidates the tools time,
and the choice. ``tilings`` re-exports every name (``tilings.HopperTiles`` and so on)."""
from __future__ import annotations

from dataclasses import dataclass, replace

#: Head dims the wgmma forward (``hopper/forward.py``) is built for.
HOPPER_HEAD_DIMS = (64, 128, 256)
#: Head dims the wgmma backward (``hopper/backward.py``) is built for. At 256, dK and dV of
#: a warpgroup's 64 keys would hold 256 fp32 accumulator registers per thread, all there
#: are: the dK/dV kernel makes two passes, each for half of the columns.
HOPPER_BWD_HEAD_DIMS = (64, 128, 256)


def dkdv_passes(head_dim: int) -> int:
    """Blocks per key tile of the wgmma dK/dV kernel, on grid z: at head dims past 128, two,
    each making half of dK's and dV's columns and computing Sᵀ and dPᵀ over the whole head
    dim (the two make 1.5x the products one block would, which would need 256 accumulator
    registers per thread)."""
    return 2 if head_dim > 128 else 1
#: Row layouts (``Variant.packed``) the wgmma kernels take: a dense batch and varlen
#: sequences (a KV cache and split-KV stay on mma.sync).
HOPPER_ROWS = ("", "varlen")


@dataclass(frozen=True)
class HopperTiles:
    """A wgmma kernel's tiling: ``warpgroups`` consumer warpgroups of 128 threads own 64
    rows each (``block_m = 64 * warpgroups``: query rows in the forward and dQ kernels,
    keys in the dK/dV kernel); the other side streams through in tiles of ``block_n``
    (one m64nNk16 per k-step of S = Q Kᵀ, or of Sᵀ = K Qᵀ, N = ``block_n``). ``overlap``:
    FlashAttention 3's intra-warpgroup schedule (the softmax of one key tile runs while the
    P V wgmmas of the one before it do; one barrier per tile instead of two).
    ``min_blocks``: blocks per multiprocessor it is compiled for (registers capped at
    65536 / (threads * min_blocks), the shared-memory carveout maximal), so that one
    block's softmax can run under another's wgmmas. ``pingpong`` (2 warpgroups, overlap;
    ``hopper/pingpong.py``): the warpgroups take turns issuing their wgmmas, K and V in
    mbarrier rings of ``stages`` stages (without ping-pong, ``stages`` 3 serves the
    backward kernels: the streamed tiles their last product reads in three buffers, so that
    a step's last products, ``dV += Pᵀ dO`` and ``dK += dSᵀ Q`` or ``dQ += dS K``, retire
    under the next step's copies and score products instead of being waited for at the
    step's end); ``producer``: and a producer warpgroup copying
    them (384 threads, ``setmaxnreg``: 24 registers to it, 240 to the consumers).
    ``poly``: every ``poly``-th 8-key n-tile of the softmax takes its exp2 from the FMA
    pipe (``intrinsics.exp2_fma``) instead of the MUFU unit (0: none), for a softcap, whose
    tanh is a second MUFU operation per score. ``persistent`` (ping-pong with a producer of
    bulk copies, square tiles; dense rows without masks; ``hopper/persistent.py``): one
    block per multiprocessor walks the query tiles (the launch's grid in its order,
    heaviest first where causal), its K/V rings running on from one tile to the next, so
    the next tile's Q and first K/V tiles load under the current one's last products and
    stores (:data:`PERSISTENT`). (A form without a producer, whose consumers copied, was
    slower than the ping-pong tiling it walked with, and is gone:
    notes/fixed_cost_varlen_cpu_2026-11-26.md.) ``tma`` (ping-pong): one thread of each
    copying warpgroup (or of the producer warpgroup) moves a K or V tile with
    the Tensor Memory Accelerator (``cp.async.bulk.tensor`` through tensor maps the launch
    makes: ``tensor_maps.py``) instead of 128 threads' ``cp.async`` copies. ``own_dq`` (the
    backward's dkdvq with a producer, ``hopper/backward_ws.py``): each consumer warpgroup
    adds the dQ part of its own 64 keys (two reductions a step), so the two never wait for
    each other, instead of each adding half the queries' over both warpgroups' keys.
    ``dynamic`` (persistent): a block takes its next query tile from a counter the blocks
    share, as the hardware's block scheduler deals blocks (a block that finishes early
    takes more: heaviest-first causal tiles balance), instead of a static walk (every
    ``G``-th tile, a snake)."""

    warpgroups: int
    block_n: int
    overlap: bool = False
    min_blocks: int = 1
    pingpong: bool = False
    stages: int = 2
    producer: bool = False
    poly: int = 0
    persistent: bool = False
    tma: bool = False
    own_dq: bool = False
    dynamic: bool = False

    def __post_init__(self):
        if (self.warpgroups not in (1, 2) or self.block_n not in (32, 64, 128, 192, 256)
                or self.min_blocks not in (1, 2, 3)):
            raise ValueError(f"warpgroups must be 1 or 2, block_n 32, 64, 128, 192 or 256, "
                             f"min_blocks 1, 2 or 3: {self}")
        if self.stages not in ((2, 3, 4) if self.pingpong else (2, 3)):
            raise ValueError(f"stages must be 2, 3 or 4 (ping-pong) or 2 or 3: {self}")
        if self.pingpong and (self.warpgroups != 2 or not self.overlap):
            raise ValueError(f"the ping-pong schedule takes 2 warpgroups and overlap: {self}")
        if self.poly not in (0, 2, 3, 4):
            raise ValueError(f"poly must be 0, 2, 3 or 4: {self}")
        if self.persistent and not (self.pingpong and self.producer and self.tma
                                    and self.block_n == self.block_m):
            raise ValueError(f"a persistent block takes the ping-pong schedule with a "
                             f"producer warpgroup of bulk copies, square tiles: {self}")
        if self.dynamic and not self.persistent:
            raise ValueError(f"a dynamic tile order serves a persistent tiling: {self}")
        if self.tma and not self.pingpong:
            raise ValueError(f"bulk tensor copies serve the ping-pong schedule: {self}")
        if self.own_dq and not (self.producer and not self.pingpong):
            raise ValueError(f"own_dq serves the backward's producer tiling: {self}")
        if self.producer and (not (self.pingpong or (self.warpgroups == 2 and self.overlap))
                              or self.min_blocks != 1):
            raise ValueError(f"a producer warpgroup serves the ping-pong schedule or two "
                             f"overlapped warpgroups (the backward's dkdv(q)), one block per "
                             f"SM: {self}")

    @property
    def tag(self) -> str:
        """``g2n128``, ``g2n128o`` (overlap), ``g1n64ob2`` (2 blocks per SM), ``g2n128op3``
        (ping-pong, 3 stages), ``g1n64od3`` (a backward kernel's last products retiring
        under the next step), ``g2n128op3w`` (and a producer warpgroup), ``g2n128op3x2``
        (every second n-tile's exp2 on the FMA pipe), ``g2n128op2wts`` (persistent),
        ``g2n128op2wtsy`` (persistent, tiles from a counter),
        ``g2n128op3t`` (K and V by bulk tensor copies): names the tiling in kernel names and
        timings."""
        return (f"g{self.warpgroups}n{self.block_n}" + ("o" if self.overlap else "")
                + (f"p{self.stages}" if self.pingpong else "")
                + (f"d{self.stages}" if not self.pingpong and self.stages != 2 else "")
                + ("w" if self.producer else "")
                + ("t" if self.tma else "")
                + (f"x{self.poly}" if self.poly else "")
                + ("s" if self.persistent else "")
                + ("y" if self.dynamic else "")
                + ("i" if self.own_dq else "")
                + (f"b{self.min_blocks}" if self.min_blocks > 1 else ""))

    @property
    def launch_bounds(self):
        """numba's ``launch_bounds`` where several blocks must fit an SM or a producer
        warpgroup hands its registers over (``setmaxnreg`` needs a cap at entry), else
        None."""
        if self.min_blocks > 1 or self.producer:
            return (self.threads, self.min_blocks)
        return None

    @property
    def block_m(self) -> int:
        return 64 * self.warpgroups

    @property
    def threads(self) -> int:
        return 128 * (self.warpgroups + self.producer)

    @property
    def warps(self) -> int:
        return self.threads // 32


#: Per (head dim, causal): the fastest of :data:`HOPPER_CANDIDATES` on an H100 (bf16, B=4
#: H=16 N=4096 and B=1 H=16 N=16384, at 5572d0e, notes/hopper_2026-11-25.md). D=64: two
#: warpgroups with the intra-warpgroup overlap on 64-key tiles, g2n64o, 329-391 TFLOP/s
#: (192-key ping-pong with a producer 267-353, g1n64ob2 311-342). D=128: the ping-pong
#: schedule on 128-key tiles in 3-stage rings, g2n128op3, 362-447 (g2n128o 329-426; its
#: producer-warpgroup form 317-382). D=64 causal since 4481bc2 (2026-11-26): one
#: warpgroup of 64 rows, two blocks per SM, g1n64ob2, as the sliding window takes: causal
#: blocks visit half the key tiles on average, so a block's start and end weigh more, and
#: the other block's work runs under them. H100, two runs at 183c3d1, TFLOP/s g1n64ob2 /
#: g2n64o: B=4 H=16 N=4096 388-394 / 376-384, B=1 H=16 N=16384 431-440 / 410-413 (non-causal
#: it loses: 375-397 / 410-423; notes/forward_experiments_2026-11-26.md). D=128 and D=64
#: non-causal since 4133bcd (2026-11-26): the ping-pong schedule with a producer warpgroup
#: whose first thread moves K and V by bulk tensor copies, g2n128op3wt (for calls of at
#: least TMA_MIN_WORK; NO_TMA's below). H200, two runs, TFLOP/s g2n128op3wt / the table's
#: before: D=128 630-652 / 599-600, causal 570-574 / 536-539, N=16384 622-627 / 566-632,
#: causal 613-667 / 568-571; D=64 424-425 / 414, N=16384 453 / 409-421
#: (notes/tma_2026-11-26.md). D=64 causal keeps g1n64ob2 (376-379 / 391 at N=4096). D=64
#: non-causal since 2026-11-26 (second session): the same on 192-key tiles, g2n192op3wt;
#: H200, two runs, TFLOP/s against g2n128op3wt: N=4096 434, 431 / 426, 421; N=16384 471,
#: 468 / 450, 453 (notes/varlen_tma_bwd_2026-11-26.md).
#: D=64 since 2026-11-27 (third session), causal and not, for calls of fewer than
#: LONG_KEYS_MIN keys: one warpgroup on 128-key tiles, three blocks per SM (164 registers
#: under the 170 the three allow, 73 KiB of shared memory each), g1n128ob3: a block's start
#: and end run under the other two's products. H200, bf16, two runs, TFLOP/s g1n128ob3 /
#: the table's before (g2n192op3wt non-causal, g1n64ob2 causal): B=4 H=16 N=4096 459, 450
#: / 432, 437, causal 416, 413 / 392, 391 (cuDNN 477-479 and 413); B=8 N=2048 439 /
#: 391, causal 352 / 338; B=16 N=1024 403 / 364 (the small calls' g2n64o), causal 280 /
#: 286; at 8192 keys and more it loses (B=4 N=8192 453 / 473, causal 408 / 440):
#: LONG_KEYS keeps g2n192op3wt there (notes/lazy_rescale_2026-11-27.md). With ALiBi or
#: the softcap too since the fourth session (it was timed unmasked first): H200, B=4 H=16
#: N=8192, one run, TFLOP/s g1n128ob3 / g1n64ob2 (causal masked calls' tiling before) /
#: g2n192op3wt: ALiBi 434 / 334 / 349, causal 438 / 367 / 341; softcap 330 / 304 / 314,
#: causal 322 / 316 / 300 (non-causal ones took g2n64o and g2n128op3wt before: 371 and
#: 330 in earlier runs; notes/long_tiles_2026-11-27.md). A window keeps WINDOW_TILES'
#: (g1n64ob2: 2550 against 2397), a score_mod MASKED_OVERLAP's.
_PP_TMA = HopperTiles(2, 128, True, pingpong=True, stages=3, producer=True, tma=True)
_PP_TMA192 = HopperTiles(2, 192, True, pingpong=True, stages=3, producer=True, tma=True)
_PS2 = HopperTiles(2, 128, True, pingpong=True, stages=2, producer=True, tma=True,
                   persistent=True)
_PS2Y = replace(_PS2, dynamic=True)
_G1N128B3 = HopperTiles(1, 128, True, 3)
HOPPER_FORWARD = {(64, False): _G1N128B3, (64, True): _G1N128B3,
                  (128, False): _PP_TMA, (128, True): _PP_TMA,
                  (256, False): HopperTiles(2, 64, True), (256, True): HopperTiles(2, 64, True)}
#: Per (head dim, causal), the forward's tiling for dense calls of at least
#: :data:`LONG_KEYS_MIN` keys without masks or modifiers (and of bulk tensor copies:
#: TMA_MIN_WORK) where it is not the table's (varlen calls keep the table's: their longest
#: sequence says little of the others; masked ones too: with ALiBi or the softcap
#: g1n128ob3 led at 8192 keys, notes/long_tiles_2026-11-27.md): at D=64
#: causal a block's fixed costs weigh less against 16384 keys than 4096, and 192-key
#: ping-pong wins there; since g1n128ob3 (the table's at D=64), non-causal too (B=4 N=8192
#: 471, 473 against 439, 453; B=1 N=16384 485 against 435). H200, two runs, TFLOP/s
#: g2n192op3wt / g1n64ob2: B=1 H=16 N=16384 454, 461 / 411, 398; B=4 H=16 N=4096 376, 373 /
#: 394, 391.
#: At D=128 the table's ping-pong tiling: PERSISTENT's lose (or tie) at 8192 keys and more (H200,
#: bf16 H=16, three runs, TFLOP/s table g2n128op3wt / g2n128op2wts / g2n128op2wtsy, causal
#: the last: B=4 N=8192 650, 644 / 618, 611 / 615, causal 598, 599 / 598, 575; B=1 N=16384
#: 671, 635, 660 / 618, 623, 623, causal 607, 633 / 601, 600; notes/dynamic_2026-11-27.md).
LONG_KEYS = {(64, False): _PP_TMA192, (64, True): _PP_TMA192,
             (128, False): _PP_TMA, (128, True): _PP_TMA}
LONG_KEYS_MIN = 8192
#: Per (head dim, causal), the forward's tiling for dense calls without masks or modifiers
#: that take the bulk tensor copies (:data:`TMA_MIN_WORK`), below :data:`LONG_KEYS_MIN`
#: keys, where it is not the table's (masked and varlen calls keep the table's, which their
#: choices were timed on; a window alone: :data:`WINDOW_PERSISTENT`): one block per SM
#: walks the query tiles (``hopper/persistent.py``'s producer form): two-stage K/V rings,
#: two Q buffers, so that the next tile's Q lands during the current one, O staged for
#: 16-byte stores, the turns carried from tile to tile. A block's start and end (about 3 µs
#: on the table's non-persistent tiling) are paid once per SM instead of once per query
#: tile. Non-causal, the static walk (g2n128op2wts); causal, the tiles from a counter
#: (g2n128op2wtsy: heaviest first, a block that finishes early takes the next), where the
#: static walk lost (387-392 against 573-576). H200, bf16 H=16, TFLOP/s table g2n128op3wt /
#: g2n128op2wts / g2n128op2wtsy (cuDNN), two runs of one machine:
#: N=1024 B=16 528, 523 / 596, 594 / 595, 591 (630), causal 355, 351 / 397, 399 / 405, 407
#: (453); N=4096 B=4 656, 655 / 681, 675 / 678, 678 (678), causal 575, 576 / 389, 392 /
#: 612, 607 (584); the static walk's N=4096 moved 657-681 over four runs, the table's
#: 651-656 (notes/dynamic_2026-11-27.md). At D=64 they lose to g1n128ob3 (N=4096 438 / 463,
#: causal 395 / 418): not taken.
PERSISTENT = {(128, False): _PS2, (128, True): _PS2Y}
#: Per (head dim, causal), the forward's tiling for varlen rows without masks (with the
#: bulk tensor copies) where it is not the table's: the persistent kernel with the tile
#: counter on the packed tile axis (every sequence's tiles in turn, each from its heaviest),
#: which pays a block's start and end once per SM. H200, 16 sequences of 128..4096 tokens,
#: H=16 D=128 bf16, the backend alone, ms (÷ the padded call's time x the work share):
#: causal 0.62 (1.25) against the table's g2n128op3wt 0.69 (1.38); non-causal it lost,
#: 1.06 (1.20) against 1.01 (1.15) (notes/dynamic_2026-11-27.md, section 6). Taken causal
#: since 84fb6da: blocks that take many varlen tiles passed on the GPU
#: (test_persistent_forward_varlen_walks_many_tiles_on_gpu), heads are the items' innermost
#: axis (the producer's scan never starts over), and a second H200 run gave 0.65 against
#: 0.73 ms (non-causal 1.14 each; notes/varlen_persistent_2026-11-27.md). Non-causal the
#: static walk (g2n128op2wts, allowed on varlen rows since 2d453ab) against the table:
#: 1.00-1.02 against 1.03 ms in two runs; taken since 2026-11-28 (seventh session: the
#: padded call it is compared with runs it too, and the forward's ratio was 1.10-1.11).
VARLEN_PERSISTENT = {(128, True): _PS2Y, (128, False): _PS2}
#: The persistent varlen tiling the GPU test checks and the tools time.
VARLEN_PERSISTENT_TRIAL = _PS2Y
#: Per head dim, the table's tilings before the bulk tensor copies, for calls that do not
#: take them (:data:`TMA_MIN_WORK`, broadcast views, CUDA-graph capture): the ping-pong
#: g2n128op3 (its consumers' cp.async copies) at D=128. (D=64's table, g1n128ob3, has no
#: copies to leave out.)
NO_TMA = {128: HopperTiles(2, 128, True, pingpong=True, stages=3)}
#: The least work, B x Hq x Nq x Nk x D, of a forward that takes the table's bulk tensor
#: copies: a call pays 20-35 µs more host time for its tensor maps (75 µs with new arrays;
#: ring of device slots, tensor_maps.py; H200 host), which a forward of this size (about
#: 0.4 ms and more at D=128) hides; smaller calls take :data:`NO_TMA`.
TMA_MIN_WORK = 1 << 36
#: Alignment of the shared tiles: a 128-byte swizzle pattern spans 1024 bytes, and a
#: descriptor's base offset stays 0 only for tiles that start on it.
HOPPER_ALIGN = 1024
#: Ping-pong with every other n-tile's exp2 on the FMA pipe (slower on the H100: kept for
#: the tool, at D=128).
_POLY2 = HopperTiles(2, 128, True, pingpong=True, stages=3, poly=2)
#: The 2-stage ping-pong, for D=256 (three stages do not fit its shared memory).
_PP2 = HopperTiles(2, 64, True, pingpong=True, stages=2)
#: Tilings tools/hopper_forward.py times against each other (and the gpu test covers).
HOPPER_CANDIDATES = (HopperTiles(2, 128), HopperTiles(2, 128, True), HopperTiles(2, 64, True),
                     HopperTiles(1, 64, True, 2),
                     HopperTiles(2, 128, True, pingpong=True, stages=3),
                     HopperTiles(2, 64, True, pingpong=True, stages=3),
                     HopperTiles(2, 128, True, pingpong=True, stages=3, producer=True),
                     HopperTiles(2, 64, True, pingpong=True, stages=3, producer=True),
                     HopperTiles(2, 192, True, pingpong=True, stages=3),
                     HopperTiles(2, 192, True, pingpong=True, stages=3, producer=True),
                     _POLY2, _PP2,
                     HopperTiles(2, 128, True, pingpong=True, stages=3, tma=True),
                     HopperTiles(2, 64, True, pingpong=True, stages=3, tma=True), _PP_TMA,
                     _PP_TMA192, _G1N128B3, _PS2, _PS2Y)
#: Tilings the tool times by name (``--tilings``) that are not candidates (the GPU tests do
#: not run them): the persistent form with a producer of bulk copies on three-stage rings
#: (one Q buffer, O stored from the registers), slower than :data:`PERSISTENT`'s
#: (notes/persistent_2026-11-27.md).
HOPPER_TRIALS = (replace(_PP_TMA, persistent=True),)
#: Head dims of a candidate where not 64 and 128: 192 keys at D=128 spill; three blocks of
#: g1n128ob3 fit the shared memory at D=64 only; 64-key ping-pong is for D=64 (64-key
#: tiles lost at D=128 before), kept off D=128 to save compiles. At
#: D=256 only 64-key tiles fit the shared memory with 128 query rows (Q 64 KiB, a K or V
#: tile 32 KiB: two stages of both, 193 KiB): the overlapped g2n64o and the 2-stage
#: ping-pong; ptxas 13: g2n64o 220-228 registers, g2n64 234, g2n64op2 208-225, no spills.
HOPPER_CANDIDATE_DIMS = {t: (64,) for t in HOPPER_CANDIDATES if t.pingpong and t.block_n != 128}
HOPPER_CANDIDATE_DIMS.update({_POLY2: (128,), _PP2: (256,), _G1N128B3: (64,),
                              HopperTiles(2, 64, True): HOPPER_HEAD_DIMS})


def hopper_candidates(head_dim: int) -> tuple:
    """The candidates built (timed, tested) at ``head_dim``."""
    return tuple(t for t in HOPPER_CANDIDATES
                 if head_dim in HOPPER_CANDIDATE_DIMS.get(t, (64, 128)))


#: The wgmma backward's tilings (``hopper/backward.py``), per (head dim, causal): one
#: warpgroup per block (64 keys in dK/dV, 64 queries in dQ; at about 200-255 registers two
#: such blocks share an SM and interleave) with query steps of 64 (D=64, D=128 non-causal)
#: or 32 (D=128 causal) and key steps of 128 (D=64) or 64 (D=128), and the overlap (the
#: elementwise work of a step under its later wgmmas): the fastest pairs on an H100 (bf16,
#: B=4 H=16 N=4096; notes/hopper_2026-11-25.md, notes/hopper_d256_bwd_2026-11-26.md). At
#: D=128 dK and dV hold 128 accumulator registers per thread: since the step's statistics
#: are read from shared memory (d6bb8d3) query steps of 64 fit with the overlap non-causal
#: (g1n64o, 255 registers: 475 against 427 TFLOP/s for g1n32o, 7f38800), and causal since
#: 2026-11-26 although ptxas 13.0 spills 12 bytes there (H200, bf16, two runs, backward
#: alone g1n64o / g1n32o: B=4 H=16 N=4096 1.902 / 2.000 and 1.891 / 2.023 ms, B=1 H=16
#: N=16384 6.961 / 7.378 and 7.210 / 7.418 ms; notes/varlen_tma_bwd_2026-11-26.md); not
#: with a window or modifiers (:data:`HOPPER_BWD_MASKED`).
#: At D=256 only steps of 32 fit the shared memory beside two warpgroups' resident tiles
#: (dK/dV: K and V of 128 keys, 128 KiB, and Q and dO double-buffered, 64 KiB; dQ: Q and
#: dO of 128 rows, K and V double-buffered), and with one warpgroup (129 KiB) one block
#: would hold an SM: g2n32o for both kernels.
#: D=64 dense rows without masks or modifiers: dK/dV in the producer form (backward_ws.py
#: without dQ's parts, g2n64od3w), H200 B=4 H=16 N=4096 backward 2.03-2.05 against 2.18-2.20
#: ms for g1n64o (notes/producer_dkdv_2026-11-28.md; at D=128 g2n32ow ties with g1n64o).
_WS64 = HopperTiles(2, 64, True, stages=3, producer=True)
HOPPER_DKDV = {(64, False): _WS64, (64, True): _WS64,
               (128, False): HopperTiles(1, 64, True), (128, True): HopperTiles(1, 64, True),
               (256, False): HopperTiles(2, 32, True), (256, True): HopperTiles(2, 32, True)}
#: dK/dV where the producer form does not serve (a window, modifiers, varlen rows).
HOPPER_DKDV_ROWS = {(64, False): HopperTiles(1, 64, True), (64, True): HopperTiles(1, 64, True)}
HOPPER_DQ = {(64, False): HopperTiles(1, 128, True), (64, True): HopperTiles(1, 128, True),
             (128, False): HopperTiles(1, 64, True), (128, True): HopperTiles(1, 64, True),
             (256, False): HopperTiles(2, 32, True), (256, True): HopperTiles(2, 32, True)}
#: The non-deterministic mode's dkdvq kernel: FlashAttention 3's structure
#: (``hopper/backward_ws.py``, a producer warpgroup and two consumer warpgroups of 64
#: keys), g2n64od3w at D=64 (H200 B=4 H=16 N=4096 backward 1.85 ms, causal 1.10; two stages
#: 1-3% slower), g2n32ow at D=128 (64-query steps spill; level with the deterministic pair
#: on the backward alone): notes/ws_copies_2026-11-27.md.
_WS128 = HopperTiles(2, 32, True, producer=True)
HOPPER_DKDVQ = {**HOPPER_DKDV, (64, False): _WS64, (64, True): _WS64,
                (128, False): _WS128, (128, True): _WS128}
#: Per head dim, the dkdvq tilings ``tools/hopper_backward.py --fused`` times beside the
#: table's: the one-warpgroup kernel (the table's before), two warpgroups without a
#: producer (each the dQ part of half a step's queries over the block's 128 keys: half the
#: additions' traffic, and no faster, section 4 of notes/backward_steps_2026-11-27.md),
#: and the producer form with two stages; at D=128 the one-warpgroup kernel and the
#: producer form with three stages. Not the ``own_dq`` form (each consumer adding
#: its own keys' dQ part): its emulated test deadlocked on its warpgroup's named barrier
#: in 2 of 5 runs, not understood yet, and its one dS tile a warpgroup is rewritten by
#: a warp whose dQ product is done while the other warps' may still read it (no barrier
#: between them): a race to mend before it runs on a GPU.
HOPPER_DKDVQ_CANDIDATES = {64: (HopperTiles(1, 64, True),
                                HopperTiles(2, 64, True),
                                HopperTiles(2, 64, True, producer=True)),
                           128: (HopperTiles(1, 32, True),
                                 HopperTiles(2, 32, True, stages=3, producer=True))}
#: Per (head dim, causal), (dK/dV, dQ) tiling pairs tools/hopper_backward.py times against
#: each other (the table's first); all compile without spills but the table's D=128 causal
#: dK/dV (12 bytes, its budget in the PTX test).
_D64 = ((_WS64, HopperTiles(1, 128, True)),
        (HopperTiles(1, 64, True), HopperTiles(1, 128, True)),
        (HopperTiles(1, 64, True, stages=3), HopperTiles(1, 128, True, stages=3)),
        (HopperTiles(1, 64, True), HopperTiles(1, 64, True)),
        (HopperTiles(1, 64, True, stages=3), HopperTiles(1, 64, True, stages=3)),
        (HopperTiles(1, 32, True, 3, stages=3), HopperTiles(1, 64, True, stages=3)),
        (HopperTiles(2, 64, True), HopperTiles(2, 128, True)),
        (HopperTiles(1, 64), HopperTiles(1, 128)))
#: (the producer form's dK/dV with two stages)
_D64_WS = ((HopperTiles(2, 64, True, producer=True), HopperTiles(1, 128, True)),)
HOPPER_BWD_CANDIDATES = {
    (64, False): _D64 + _D64_WS, (64, True): _D64 + _D64_WS,
    (128, False): ((HopperTiles(1, 64, True), HopperTiles(1, 64, True)),
                   (_WS128, HopperTiles(1, 64, True)),
                   (HopperTiles(1, 64, True), HopperTiles(1, 64, True, stages=3)),
                   (HopperTiles(1, 32, True), HopperTiles(1, 64, True)),
                   (HopperTiles(1, 64), HopperTiles(1, 64, True)),
                   (HopperTiles(2, 64), HopperTiles(2, 64, True))),
    (128, True): ((HopperTiles(1, 64, True), HopperTiles(1, 64, True)),
                  (_WS128, HopperTiles(1, 64, True)),
                  (HopperTiles(1, 64, True), HopperTiles(1, 64, True, stages=3)),
                  (HopperTiles(1, 32, True), HopperTiles(1, 64, True)),
                  (HopperTiles(2, 32, True), HopperTiles(2, 64, True)),
                  (HopperTiles(2, 32, True), HopperTiles(2, 128, True)),
                  (HopperTiles(1, 64), HopperTiles(1, 64, True))),
    (256, False): ((HopperTiles(2, 32, True), HopperTiles(2, 32, True)),
                   (HopperTiles(2, 32), HopperTiles(2, 32))),
    (256, True): ((HopperTiles(2, 32, True), HopperTiles(2, 32, True)),
                  (HopperTiles(2, 32), HopperTiles(2, 32))),
}
_HOPPER_TABLES = {"forward": HOPPER_FORWARD, "dkdv": HOPPER_DKDV, "dq": HOPPER_DQ,
                  "dkdvq": HOPPER_DKDVQ}


def hopper_smem_bytes(t: HopperTiles, head_dim: int, kernel: str = "forward") -> int:
    """Shared memory of a wgmma kernel, 16-bit elements, plus :data:`HOPPER_ALIGN` bytes to
    align the dynamic shared memory's start at run time: the forward, Q (``block_m`` rows)
    and K and V in ``stages`` buffers each (``block_n`` rows; the ping-pong schedule adds
    its rings' 8-byte mbarriers: 4 a stage, 1 for Q with a producer, 2 for a persistent
    one's); dK/dV, K and V
    (``block_m``) and Q and dO double-buffered (dkdvq: and per warpgroup a dSᵀ tile of
    ``block_n`` lines of 64 keys and two buffers of dQ rows), then two buffers of the query
    steps' lse and delta (fp32); dQ, Q and dO and K and V double-buffered. ``stages`` 3
    (a backward tiling): Q and dO (dK/dV) or K (dQ), which a step's last products read, in
    three buffers."""
    if kernel == "forward":
        # (a persistent one with two-stage rings: two Q buffers and a tile of O rows, two
        # more barriers)
        staged = t.persistent and t.stages == 2
        return (HOPPER_ALIGN + ((1 + 2 * staged) * t.block_m + 2 * t.stages * t.block_n)
                * head_dim * 2
                + ((4 * t.stages + t.producer * (1 + t.persistent) * (1 + staged)) * 8
                   if t.pingpong else 0)
                + 64 * t.persistent)  # (eight words per Q buffer: the tile its Q is of)
    # dkdvq: per warpgroup a dSᵀ tile and two staging buffers of dQ rows
    if t.producer:  # (hopper/backward_ws.py's layout; dkdv: without dQ's tiles)
        stats = -(-t.stages * 8 * t.block_n // HOPPER_ALIGN) * HOPPER_ALIGN
        own = 2 if t.own_dq else 1  # (own_dq: one dS tile, staging per warpgroup)
        dq = kernel == "dkdvq"
        return (HOPPER_ALIGN + (2 * t.block_m + 2 * t.stages * t.block_n) * head_dim * 2
                + stats + dq * (2 * 2 * t.block_n * 128 // own
                                + 2 * own * t.block_n * head_dim * 4)
                + (2 * t.stages + 4 * own * dq) * 8)
    # (two warpgroups: each stages half the step's queries)
    ds = (t.warpgroups * t.block_n * (128 + 8 * head_dim // t.warpgroups)
          if kernel == "dkdvq" else 0)
    # dK/dV: and two buffers of the query steps' lse and delta (fp32)
    stats = 16 * t.block_n if kernel in ("dkdv", "dkdvq") else 0
    streamed = (t.stages + 2 if kernel == "dq" else 2 * t.stages) * t.block_n
    return HOPPER_ALIGN + (2 * t.block_m + streamed) * head_dim * 2 + ds + stats


#: The wgmma forward's tiling for variants with a mask_mod, where :data:`MASK_MOD_TILES`
#: has none for the head dim: a schedule without the overlap (an empty tile is skipped
#: between its copies and the next tile's).
HOPPER_MASK_MOD = HopperTiles(2, 64)
#: Per (head dim, another mask or modifier beside it: a score_mod, the softcap, ALiBi or a
#: window), an overlapped tiling a forward with a mask_mod takes instead: it visits the key
#: range the classes leave (``seams.visited_keys``), each tile of it by its class (PARTIAL:
#: the mask_mod per score; EMPTY: P = 0 without asking it, its products not skipped).
#: H200, B=4 H=16 N=8192 bf16 non-causal, documents by a mask_mod with a block_mask,
#: forward time over the unmasked forward's (`tools/mask_mod_forward.py`, 7b24184-64ca341;
#: 8 equal documents / 8 unequal ones): D=128 g2n64 0.359-0.364 / 0.662-0.673, g2n64o
#: 0.329 / 0.589, **g2n128o 0.281 / 0.533** (ptxas 13.0: 92-136 bytes of spill loads with a
#: document mask_mod); D=64 g2n64 0.436 / 0.790, **g2n64o 0.388 / 0.705** (no spills). With
#: a score_mod beside it g2n128o spills 1088 bytes at D=128 (a table-reading one) and
#: g2n64o 8-16: not timed, so those keep :data:`HOPPER_MASK_MOD`, as do a window, the
#: softcap or ALiBi beside the mask_mod, and D=256 (g2n64o spills 120 bytes there).
MASK_MOD_TILES: dict = {(64, False): HopperTiles(2, 64, True),
                        (128, False): HopperTiles(2, 128, True)}


#: The wgmma backward's tilings with a softcap, per (kernel, head dim) where the table's
#: do not take one (ptxas 13.0). dQ at D=64: 128-key steps (g1n128o) spill 24-32 bytes
#: with a causal window; 64-key steps (g1n64o) take 158-167 registers. (dK/dV at D=64 took
#: g1n64 until the step's statistics moved to shared memory: the overlapped g1n64o held
#: the softcap's derivatives through the step too and ptxas serialized its wgmmas, C7519,
#: at 246-250 registers; now 247-252, not serialized.)
HOPPER_BWD_SOFTCAP = {("dq", 64): HopperTiles(1, 64, True)}
#: The wgmma backward's tilings with any mask or modifier (a window, the softcap, ALiBi:
#: their per-score work holds more registers), per (kernel, head dim) where the table's do
#: not take them: the dK/dV kernel at D=128 non-causal steps 64 queries (g1n64o, 255
#: registers), which spills 12-152 bytes with them (ptxas 13.0), and so does causal (its
#: 12 bytes without them); they keep the 32-query steps (g1n32o).
HOPPER_BWD_MASKED = {("dkdv", 128): HopperTiles(1, 32, True)}
#: The wgmma backward's tilings with the user's mods, per (kernel, head dim) where the
#: masked ones above do not take them (ptxas 13.0, bf16, a score_mod reading a table and a
#: mask_mod reading document ids): the dK/dV kernel at D=64 steps 32 queries (g1n32o, 254
#: registers, no spills; 64-query steps spilled 16-48 bytes, and ptxas serialized their
#: wgmmas non-causal), the dQ kernel 64 keys (g1n64o, 246-254; a mask_mod alone on the
#: table's 128-key steps spilled 40-48 bytes). Causal at D=128 and 256 ptxas still spills
#: 8-84 bytes in some of them (how many registers a mod takes is the user's): the PTX
#: test's budget, ``USER_SPILL``.
HOPPER_BWD_USER = {("dkdv", 64): HopperTiles(1, 32, True), ("dq", 64): HopperTiles(1, 64, True)}
#: Of varlen rows with the user's mods, per (kernel, head dim, causal), where
#: :data:`HOPPER_BWD_USER`'s do not take them (the sequence offsets hold registers too;
#: ptxas 13.0, fp16, the same two mods): the causal dQ kernel at D=128 takes 32-key tiles
#: (g1n32o, 232 registers, no spills; g1n64o spilled 224 bytes). Causal D=128 dK/dV
#: (g1n32o) spills 120 bytes and D=256 76-116: the PTX test's ``USER_SPILL_VARLEN``.
HOPPER_BWD_USER_VARLEN = {("dq", 128, True): HopperTiles(1, 32, True)}


def choose_hopper(head_dim: int, causal: bool, kernel: str = "forward",
                  mask_mod: bool = False, softcap: bool = False,
                  masked: bool = False, long_keys: bool = False,
                  dense: bool = False, user: bool = False,
                  varlen: bool = False, beside: bool = False) -> HopperTiles | None:
    """The tiling of wgmma kernel ``kernel`` (forward, dkdv, dq) at ``head_dim``
    (``mask_mod``: of a forward with one, ``beside`` another mask or modifier with it;
    ``softcap``: of a backward kernel with one or with a score_mod (both keep each score's
    derivative through the step); ``masked``: of
    a backward kernel with a window, the softcap, ALiBi or the user's mods (a forward's
    masks and modifiers: :func:`masked_tiles`); ``long_keys``: of a forward of
    :data:`LONG_KEYS_MIN` keys or more; ``dense``: of a forward of a dense
    batch without masks that takes the bulk tensor copies: :data:`PERSISTENT`'s; ``user``:
    of a backward kernel with the user's mods, :data:`HOPPER_BWD_USER`'s; and ``varlen``
    rows, :data:`HOPPER_BWD_USER_VARLEN`'s), or None where it has none. The table's dK/dV
    producer form serves dense rows without masks or modifiers: with ``masked``,
    ``softcap``, ``user`` or ``varlen`` :data:`HOPPER_DKDV_ROWS`' tiling instead."""
    t = _HOPPER_TABLES[kernel].get((head_dim, bool(causal)))
    if t is not None and t.producer and kernel == "dkdv" and (masked or softcap or user
                                                              or varlen):
        t = HOPPER_DKDV_ROWS.get((head_dim, bool(causal)), replace(t, producer=False))
    if dense and kernel == "forward":
        t = PERSISTENT.get((head_dim, bool(causal)), t)
    if long_keys and kernel == "forward":
        t = LONG_KEYS.get((head_dim, bool(causal)), t)
    if t is not None and softcap and kernel != "forward":
        t = HOPPER_BWD_SOFTCAP.get((kernel, head_dim), t)
    if t is not None and (masked or softcap) and kernel != "forward":
        t = HOPPER_BWD_MASKED.get((kernel, head_dim), t)
    if t is not None and user and kernel != "forward":
        t = HOPPER_BWD_USER.get((kernel, head_dim), t)
        if varlen:
            t = HOPPER_BWD_USER_VARLEN.get((kernel, head_dim, bool(causal)), t)
    if t is not None and mask_mod and t.overlap and kernel == "forward":
        t = MASK_MOD_TILES.get((head_dim, bool(beside)), HOPPER_MASK_MOD)
    return t


#: ``HopperTiles.poly`` of a forward with a softcap (0: every exp2 on the MUFU unit). On an
#: H100 (B=4 H=16 N=8192 D=128 bf16, 4234736) every other n-tile's exp2 on the FMA pipe
#: made the softcap slower (1.27-1.29x its time without a mask, against 1.11-1.16x), and
#: ALiBi 1.22-1.29x (against 1.01): the FP32 pipe, not the MUFU unit, is what the softmax
#: fills there.
SOFTCAP_POLY = 0
#: The most keys a tile of a ping-pong forward with a softcap takes: the D=64 table's
#: 192-key tiles lose with one (H200, B=4 H=16 N=8192 D=64 bf16, softcap 30, TFLOP/s
#: g2n192op3wt / g2n128op3wt: 311 / 330, causal 302 / 317; without it 473 / 446).
SOFTCAP_KEYS = 128


#: Per head dim, the wgmma forward's tiling for a sliding window: one warpgroup of 64 query
#: rows, two blocks per SM. A window leaves each block few key tiles (9-10 of 128 keys for
#: a window of 1024), so its prologue and epilogue weigh more, and the second block's work
#: runs under them. H100, B=4 H=16 N=8192 bf16, window 1024, time ÷ the unmasked forward's
#: (the table's tiling), non-causal / causal, at bfc383a: D=64 0.181 / 0.222 (the
#: overlapped g2n64o that windows took before: 0.288 / 0.39); D=128 0.189 / 0.289
#: (g2n128o: 0.228 / 0.323); the unmasked D=128 forward moved by 10% between runs.
WINDOW_TILES = {64: HopperTiles(1, 64, True, 2), 128: HopperTiles(1, 64, True, 2)}
#: Per head dim, the forward's tiling for a sliding window alone (no other mask or
#: modifier; dense rows, with the bulk tensor copies): the persistent kernel taking its
#: tiles from a counter, each query tile's keys from the window's first tile, its edge
#: tiles masked. H200, bf16 H=16, window 1024, one run, TFLOP/s of the whole N² work
#: g1n64ob2 (WINDOW_TILES') / g2n128op2wts / g2n128op2wtsy: D=128 B=4 N=4096 1599 / 1829 /
#: 1864, causal 1171 / 1128 / 1180; N=8192 2884 / 3340 / 3408, causal 2257 / 2290 / 2321;
#: B=1 N=16384 4991 / 5824 / 5998, causal 4154 / 4062 / 4225; B=16 N=1024 501 / 521 / 607,
#: causal 356 / 362 / 348. At D=64 g1n64ob2 leads (N=8192 2483 / 2190 / 2199, causal 1905
#: / 1335 / 1334): not taken.
WINDOW_PERSISTENT = {128: _PS2Y}
#: Per head dim, the forward's tiling for a mask_mod with no score modifier beside it (a
#: window or causal may be; dense or varlen rows, with the bulk tensor copies): the
#: persistent kernel taking its tiles from a counter, each query tile's keys cut to the
#: span its classes leave (``persistent.class_keys``), a PARTIAL tile masked per score, an
#: EMPTY one inside the span computed with its scores -inf (as ``forward.classed_softmax``
#: does). H200, B=4 H=16 N=8192 bf16, 8 equal documents, time over the unmasked forward's:
#: 0.208 (causal 0.254) against 0.303 (0.428) on the overlapped g2n128o
#: (:data:`MASK_MOD_TILES`; notes/mask_mod_persistent_2026-11-28.md; FlexAttention 0.18).
MASK_MOD_PERSISTENT = {128: _PS2Y}
#: The tables whose tiling replaces the table's for some calls with the persistent kernel
#: (tests and tools that time or check a named tiling empty them).
PERSISTENT_TABLES = (PERSISTENT, WINDOW_PERSISTENT, VARLEN_PERSISTENT, MASK_MOD_PERSISTENT)


#: Per head dim, the overlapped tiling that masks other than the softcap and ALiBi take
#: where the table's is a ping-pong one (the table's overlapped tilings before the bulk
#: tensor copies: at D=64 64-key tiles, g2n64o, at D=128 g2n128o), and a score_mod where
#: the table's runs three blocks an SM.
MASKED_OVERLAP = {64: HopperTiles(2, 64, True), 128: HopperTiles(2, 128, True)}


def masked_tiles(t: HopperTiles, score_mod: bool = False, softcap: bool = False,
                 window: bool = False, head_dim: int = 0, alibi: bool = False) -> HopperTiles:
    """The tiling a forward with masks or score modifiers (but a mask_mod: :func:`choose_hopper`)
    takes instead of ``t`` (without a producer warpgroup of cp.async copies, whose tiles
    start at key 0; a producer of bulk tensor copies stays). Ping-pong serves a ``softcap``
    (its tanh, a second MUFU operation per score, runs under the other warpgroup's
    products) and ``alibi``, unless a ``score_mod`` comes with them; the other masks take
    the overlapped schedule of the same block shape. On an H100 (B=4 H=16 N=8192 D=128
    bf16, time over the same tiling's without a mask, non-causal / causal): softcap 1.16 /
    1.11 in ping-pong, 1.22 / 1.21 overlapped (the softcap keeps the table's ping-pong
    tiling, its producer of bulk tensor copies too, on tiles of at most
    :data:`SOFTCAP_KEYS` keys); a window of 1024 0.197 / 0.264 in ping-pong, 0.189 / 0.256
    overlapped; and a score_mod spills in ping-pong (the relative-bias one 392 bytes at
    D=128, ptxas 13.0; 304 overlapped); they take :data:`MASKED_OVERLAP`, and so does a
    score_mod where ``t`` runs three blocks an SM (168 registers: the relative-bias one
    spills 900 bytes in g1n128ob3 at D=64, none in g2n64o). ALiBi took the overlapped
    schedule too until 2026-11-27 (1.10 / 1.01 of its tiling's unmasked time in ping-pong,
    1.01 / 1.00 overlapped, on an H100 before the bulk copies); on the H200 with them (same
    shape, one run, TFLOP/s) g2n128op3wt with ALiBi 613 / 575 against g2n128o's 451 / 446,
    1.10 of the table's unmasked time (notes/long_tiles_2026-11-27.md). A ``window``
    takes :data:`WINDOW_TILES` where it has one for ``head_dim`` (but with a mask_mod,
    whose empty tiles are skipped in :data:`HOPPER_MASK_MOD`'s schedule)."""
    if t.persistent:  # (the persistent kernel takes a window, no other mask)
        if not (score_mod or softcap or alibi):
            return t
        t = replace(t, persistent=False, dynamic=False)
    if window and head_dim in WINDOW_TILES and t.overlap:  # (not a mask_mod's schedule)
        return WINDOW_TILES[head_dim]
    spills = score_mod and (t.pingpong or t.min_blocks > 2)  # (a user's score_mod there)
    if spills or (t.pingpong and not (softcap or alibi)):
        return MASKED_OVERLAP.get(head_dim, replace(t, pingpong=False, stages=2,
                                                    producer=False, tma=False))
    if t.producer and not t.tma:  # (a producer of cp.async copies has no mask steps)
        t = replace(t, producer=False)
    if softcap and t.block_n > SOFTCAP_KEYS:
        t = replace(t, block_n=SOFTCAP_KEYS)
    return replace(t, poly=t.poly or (SOFTCAP_POLY if softcap else 0))
