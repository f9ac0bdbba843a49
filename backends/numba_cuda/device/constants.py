"""Constants every kernel family uses, in the types the kernels compute with."""
from __future__ import annotations

import numpy as np

from .convert import SIMULATOR

#: fastmath flags of every kernel and of the user's mods compiled into them; no "ninf": the
#: softmax relies on -inf. ("arcp" lets a division by a constant in a score_mod become a
#: multiplication: one MUFU op per score fewer than ``div.full``.)
FASTMATH = {"contract", "arcp", "nsz"}
#: Dynamic shared memory starts 16-byte aligned (vector loads, cp.async, ldmatrix); the
#: simulator takes no alignment argument.
SMEM_ALIGN = None if SIMULATOR else 16
#: Scores are kept in log2 units (``S · scale · log2 e``), so the softmax uses exp2.
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: fp32 infinities: comparing with Python's math.inf would compute in fp64.
NEG_INF = np.float32(-np.inf)
POS_INF = np.float32(np.inf)
#: The smallest normal float32.
FLT_MIN = 1.1754943508222875e-38
#: Query and key rows per tile class of a BlockMask (flashcore._mods.BLOCK).
CLASS_BLOCK = 128
#: Tile classes (flashcore._mods: EMPTY, PARTIAL, FULL).
EMPTY, PARTIAL, FULL = 0, 1, 2
#: How a variant's rows are laid out (Variant.packed -> the kernels' compile-time code): a
#: dense batch; packed variable-length sequences; a KV cache, contiguous or paged.
DENSE, VARLEN, CACHE, PAGED = 0, 1, 2, 3
PACKING = {"": DENSE, "varlen": VARLEN, "cache": CACHE, "paged": PAGED}
#: Rows of the grid (batch x heads) whose tiles a causal wgmma grid hands out together,
#: heaviest first (``prologue.block_tile``): the blocks running at once then share few heads' keys
#: and values in L2. Handed out across all heads, the 132-264 blocks an H100 runs at once
#: were about two per head at B=4 H=16, each reading its head's keys from HBM; 8 heads'
#: keys and values at N=8192, D=128, bf16 are 32 MB, inside the 50 MB L2.
HEAD_GROUP = 8
