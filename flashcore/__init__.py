"""flashcore: exact FlashAttention in Python with Numba, on arrays of any library.

>>> import numpy as np, flashcore
>>> q = k = v = np.random.default_rng(0).standard_normal((1, 2, 8, 16), dtype=np.float32)
>>> flashcore.attention(q, k, v, causal=True).shape
(1, 2, 8, 16)
"""
from ._api import attention, attention_backward, attention_forward, available_backends
from ._errors import BackendUnavailableError
from ._kvcache import attention_with_kvcache
from ._mods import BlockMask, create_block_mask
from ._varlen import attention_varlen, attention_varlen_backward, attention_varlen_forward

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_forward",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_forward",
    "attention_varlen_backward",
    "attention_with_kvcache",
    "available_backends",
    "BackendUnavailableError",
    "BlockMask",
    "create_block_mask",
]
