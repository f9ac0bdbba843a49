"""The masked benchmark cases: the ``mask`` of a :class:`~flashcore.bench.config.Config`, what
fraction of the scores it leaves visible, and how each contender is given it.

A mask is a short string (``python -m flashcore bench --masks ...``):

``none``
    No mask beyond ``causal`` (the default; results, labels and JSON are those of a bench
    without masks).
``window:W``
    A sliding window of ``W`` keys per query: ``window=(W // 2, W - W // 2 - 1)``, non-causal
    unless the config is causal (which then also hides the keys after the query).
``docs:K``
    ``K`` documents of equal length (the last takes the remainder): a query sees the keys of
    its own document, by the module-level ``mask_mod`` :func:`same_doc` with
    ``mod_args=(doc,)``, ``doc`` an int64 ``(B, N)`` array of document ids. flashcore is given
    a ``block_mask`` from :func:`flashcore.create_block_mask`, made once when the case is
    prepared, outside the timed region.
``softcap:C``
    ``softcap=C``: ``s = C * tanh(s / C)``.
``softcap-py:C``
    The same softcap written as a Python ``score_mod`` (:func:`softcap_mod`), to compare a
    user's score_mod with the built-in.
``alibi``
    ALiBi with FlashAttention-2's slopes ``2 ** (-8 (h + 1) / H)`` (float32, one per head).
``relpos``
    A relative-position bias as a Python ``score_mod``: :func:`relpos` = ``s + 0.01 (j - i)``.

Peers get the same scores where they can express them: torch SDPA a boolean ``attn_mask``
(window, docs) or a float additive ``attn_mask`` (alibi, relpos), with ``causal`` folded into
it; SDPA has no softcap, so softcap cases skip it with that reason. FlexAttention gets the
same rules as ``score_mod``/``mask_mod`` and a ``block_mask`` of its own, made once. The naive
contender applies the same boolean mask or additive bias to its score matrix.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

#: The mask kinds, and whether each takes a number after a colon.
KINDS = {"none": None, "window": int, "docs": int, "softcap": float, "softcap-py": float,
         "alibi": None, "relpos": None}
#: Masks that leave only part of the score matrix visible (the others modify scores).
SPARSE = ("window", "docs")
#: Bias of :func:`relpos` per position of distance.
RELPOS_SLOPE = 0.01


@dataclass(frozen=True)
class Mask:
    """A parsed mask string: ``kind`` and its number (None for ``none``, ``alibi``,
    ``relpos``)."""

    kind: str = "none"
    value: float | int | None = None

    @property
    def text(self) -> str:
        if self.value is None:
            return self.kind
        v = self.value
        return f"{self.kind}:{int(v) if float(v).is_integer() else v}"

    def window(self) -> tuple[int, int] | None:
        """The ``(left, right)`` window flashcore is given (None for other kinds): ``W``
        keys per query, ``W // 2`` of them before it; ``causal`` hides those after it."""
        if self.kind != "window":
            return None
        w = int(self.value)
        return (w // 2, w - w // 2 - 1)


def parse_mask(text: str) -> Mask:
    """``"window:512"`` -> ``Mask("window", 512)``; ValueError naming what is wrong."""
    if isinstance(text, Mask):
        return text
    t = str(text).strip()
    kind, sep, arg = t.partition(":")
    if kind not in KINDS:
        raise ValueError(f"mask {t!r}: {kind!r} is not one of {', '.join(KINDS)}")
    conv = KINDS[kind]
    if conv is None:
        if sep:
            raise ValueError(f"mask {t!r}: {kind} takes no number")
        return Mask(kind)
    if not sep or not arg:
        raise ValueError(f"mask {t!r}: {kind} needs a number, as in {kind}:"
                         f"{'512' if conv is int else '30'}")
    try:
        value = conv(arg)
    except ValueError:
        raise ValueError(f"mask {t!r}: {arg!r} is not a{'n integer' if conv is int else ' number'}"
                         ) from None
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"mask {t!r}: the number must be positive")
    return Mask(kind, value)


def canonical(text: str) -> str:
    """The mask string as the Config keeps it (``"softcap:30.0"`` -> ``"softcap:30"``)."""
    return parse_mask(text).text


# --- the user functions flashcore compiles (module level: one compile per process) --------


def same_doc(b, h, i, j, doc):
    """mask_mod of ``docs:K``: query ``i`` sees key ``j`` of the same document."""
    return doc[b, i] == doc[b, j]


def relpos(s, b, h, i, j):
    """score_mod of ``relpos``: a bias linear in the distance ``j - i``."""
    return s + RELPOS_SLOPE * (j - i)


@functools.lru_cache(maxsize=None)
def softcap_mod(cap: float):
    """score_mod of ``softcap-py:C``: ``C * tanh(s / C)`` with ``C`` a constant of the
    function (one function per ``C``, so each ``C`` compiles once)."""
    cap = float(cap)

    def softcap_py(s, b, h, i, j):
        return cap * math.tanh(s / cap)

    return softcap_py


# --- what the mask leaves visible --------------------------------------------------------


def doc_lengths(n: int, k: int) -> list[int]:
    """Lengths of ``k`` equal documents in ``n`` positions (the last takes the remainder;
    fewer documents when ``k > n``)."""
    k = min(k, n)
    size = n // k
    return [size] * (k - 1) + [n - size * (k - 1)]


def doc_ids(batch: int, n: int, k: int) -> np.ndarray:
    """The int64 ``(B, N)`` document ids of ``docs:K``."""
    ids = np.repeat(np.arange(len(doc_lengths(n, k)), dtype=np.int64), doc_lengths(n, k))
    return np.ascontiguousarray(np.broadcast_to(ids, (batch, n)))


def visible_fraction(mask: Mask | str, n: int, causal: bool) -> float:
    """The fraction of the ``N x N`` scores a configuration computes, for the FLOP model.

    ``none`` and the score modifiers (softcap, alibi, relpos) keep the bench's nominal
    convention: 1, or 1/2 when causal. ``window`` and ``docs`` count the visible pairs
    exactly (about ``W / N`` and ``1 / K``; causal about half of that)."""
    m = parse_mask(mask)
    if m.kind not in SPARSE:
        return 0.5 if causal else 1.0
    if m.kind == "docs":
        pairs = sum(s * (s + 1) // 2 if causal else s * s for s in doc_lengths(n, int(m.value)))
        return pairs / (n * n)
    left, right = m.window()
    right = 0 if causal else right
    i = np.arange(n, dtype=np.int64)
    lo = np.maximum(i - left, 0)
    hi = np.minimum(i + right, n - 1)
    return float(np.sum(hi - lo + 1)) / (n * n)


def label(mask: Mask | str) -> str:
    """How the table heading names the mask (and how flashcore is given it)."""
    m = parse_mask(mask)
    if m.kind == "docs":
        return f"{m.text} (flashcore: mask_mod same_doc + block_mask made untimed)"
    if m.kind == "softcap-py":
        return f"{m.text} (softcap as a Python score_mod)"
    if m.kind == "relpos":
        return f"{m.text} (score_mod s + {RELPOS_SLOPE}(j - i))"
    return m.text


# --- how each contender is given the mask ------------------------------------------------


def alibi_slopes(heads: int) -> np.ndarray:
    """FlashAttention-2's ALiBi slopes ``2 ** (-8 (h + 1) / H)``, float32 ``(H,)``."""
    return (2.0 ** (-8.0 * (np.arange(heads) + 1) / heads)).astype(np.float32)


def flashcore_options(config, convert=None) -> dict:
    """The keyword arguments of :func:`flashcore.attention` for ``config.mask``, its arrays
    passed through ``convert`` (NumPy array -> the contender's library and device; None:
    kept as they are); ``docs`` makes its BlockMask here, once."""
    convert = convert or (lambda a: a)
    m = parse_mask(config.mask)
    if m.kind == "none":
        return {}
    if m.kind == "window":
        return {"window": m.window()}
    if m.kind == "softcap":
        return {"softcap": float(m.value)}
    if m.kind == "softcap-py":
        return {"score_mod": softcap_mod(float(m.value))}
    if m.kind == "relpos":
        return {"score_mod": relpos}
    if m.kind == "alibi":
        return {"alibi_slopes": convert(alibi_slopes(config.heads))}
    import flashcore

    doc = doc_ids(config.batch, config.seqlen, int(m.value))
    bm = flashcore.create_block_mask(same_doc, config.batch, None, config.seqlen,
                                     config.seqlen, mod_args=(doc,))
    return {"mask_mod": same_doc, "mod_args": (convert(doc),),
            "block_mask": bm}


def dense_visible(config) -> np.ndarray | None:
    """The boolean visibility ``(B, 1, N, N)`` of a sparse mask with ``causal`` folded in,
    or None for ``none`` and the score modifiers."""
    m = parse_mask(config.mask)
    if m.kind not in SPARSE:
        return None
    n = config.seqlen
    i = np.arange(n)[:, None]
    j = np.arange(n)[None, :]
    if m.kind == "window":
        left, right = m.window()
        vis = (j >= i - left) & (j <= i + (0 if config.causal else right))
        return vis[None, None]
    doc = doc_ids(config.batch, n, int(m.value))
    vis = doc[:, :, None] == doc[:, None, :]
    if config.causal:
        vis &= j <= i
    return vis[:, None]


def dense_bias(config) -> np.ndarray | None:
    """The additive bias of ``alibi`` (``(1, H, N, N)``) or ``relpos`` (``(1, 1, N, N)``),
    ``-inf`` above the diagonal when causal, float64 for float64 configs, else float32; None
    for the other masks."""
    m = parse_mask(config.mask)
    if m.kind not in ("alibi", "relpos"):
        return None
    dt = np.float64 if config.dtype == "float64" else np.float32
    n = config.seqlen
    d = (np.arange(n)[None, :] - np.arange(n)[:, None]).astype(dt)  # j - i
    if m.kind == "relpos":
        bias = (RELPOS_SLOPE * d)[None, None]
    else:
        slopes = alibi_slopes(config.heads).astype(dt)
        bias = (-slopes[:, None, None] * np.abs(d)[None])[None]
    if config.causal:
        bias = np.where(d > 0, -np.inf, bias)
    return bias.astype(dt, copy=False)


def dense_bytes(config) -> int:
    """Bytes of the dense mask or bias a peer is given (0 where it needs none)."""
    m = parse_mask(config.mask)
    n2 = config.seqlen * config.seqlen
    if m.kind == "window":
        return n2
    if m.kind == "docs":
        return config.batch * n2
    if m.kind == "alibi":
        return 4 * config.heads * n2
    if m.kind == "relpos":
        return 4 * n2
    return 0


def flashcore_how(config) -> str:
    """How :func:`flashcore_options` gives flashcore ``config.mask``."""
    m = parse_mask(config.mask)
    return {"none": "", "window": f"window={m.window()}",
            "docs": "mask_mod same_doc, mod_args=(doc,), block_mask made untimed",
            "softcap": f"softcap={m.value}", "softcap-py": "score_mod softcap_py (Python)",
            "alibi": "alibi_slopes (H,) float32", "relpos": "score_mod relpos (Python)",
            }[m.kind]


def dense_how(config, what: str = "attn_mask") -> str:
    """How a peer given :func:`dense_visible` or :func:`dense_bias` gets ``config.mask``."""
    m = parse_mask(config.mask)
    if m.kind in SPARSE:
        shape = "(1,1,N,N)" if m.kind == "window" else "(B,1,N,N)"
        return f"boolean {what} {shape}" + (", causal folded in" if config.causal else "")
    if m.kind in ("alibi", "relpos"):
        shape = "(1,H,N,N)" if m.kind == "alibi" else "(1,1,N,N)"
        return f"float additive {what} {shape}" + (", causal as -inf" if config.causal else "")
    if m.kind in ("softcap", "softcap-py"):
        return f"C*tanh(s/C) on the {what}"
    return ""
