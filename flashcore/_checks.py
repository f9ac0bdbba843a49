"""Argument checks: every mistake a caller can make becomes a clear TypeError or ValueError.

Errors name the argument and the value it had; nothing here uses ``assert``.
"""
from __future__ import annotations

import math
import numbers

import numpy as np

from . import _interop
from ._case import DTYPES, LAYOUTS, Case
from ._mods import check_mods


def check_array(name: str, x) -> str:
    """The library of ``x``; a TypeError naming ``name`` where it is not an array."""
    lib = _interop.library_of(x)
    if lib is None:
        raise TypeError(
            f"{name} must be an array (NumPy, PyTorch, JAX, CuPy or another Array API "
            f"library); got {type(x).__module__}.{type(x).__qualname__}"
        )
    return lib


def _arrays(named: dict):
    """Check that every value is an array of one library on one device; return (library, device)."""
    libs = {name: check_array(name, x) for name, x in named.items()}
    if len(set(libs.values())) > 1:
        raise TypeError(f"all arrays must come from one library; got {libs}")
    library = next(iter(libs.values()))
    devices = {name: _interop.device_of(x, library) for name, x in named.items()}
    if len(set(devices.values())) > 1:
        raise ValueError(f"all arrays must be on one device; got {devices}")
    return library, next(iter(devices.values()))


def _dtype(named: dict) -> str:
    dtypes = {name: _interop.dtype_name(x) for name, x in named.items()}
    for name, dt in dtypes.items():
        if dt not in DTYPES:
            raise TypeError(
                f"{name} has dtype {dt}; flashcore computes on {', '.join(DTYPES)}"
            )
    if len(set(dtypes.values())) > 1:
        raise TypeError(f"q, k and v must share one dtype; got {dtypes}")
    return next(iter(dtypes.values()))


def _shape4(name, x, layout):
    shape = tuple(map(int, x.shape))
    if len(shape) != 4:
        dims = "(B, H, N, D)" if layout == "bhnd" else "(B, N, H, D)"
        raise ValueError(
            f"{name} must have 4 dimensions {dims} for {layout=}; got {name}.shape={shape}"
        )
    return shape


def check_flag(name, value):
    """A flag is True or False (a NumPy bool too): not 2, "yes" or None."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False; got {name}={value!r}")


def check_heads(qs, ks, hq_axis, hkv_axis, k_name="k"):
    """``(Hq, Hkv, D)`` of q's shape ``qs`` and ``k_name``'s ``ks``: one head dim of at
    least 1, at least one key/value head, and query heads a multiple of them (GQA; no
    query head is a multiple too: an empty call, as B=0 or N=0 are)."""
    Hq, Hkv = qs[hq_axis], ks[hkv_axis]
    if qs[-1] != ks[-1]:
        raise ValueError(f"q and {k_name} must have one head dim; got q.shape={qs}, "
                         f"{k_name}.shape={ks}")
    if qs[-1] < 1:
        raise ValueError(f"the head dim must be at least 1; got q.shape={qs}")
    if Hkv < 1:
        raise ValueError(f"{k_name} must have at least one head; got Hq={Hq}, Hkv={Hkv} "
                         f"from q.shape={qs}, {k_name}.shape={ks}")
    if Hq % Hkv != 0:
        raise ValueError(f"the number of query heads must be a multiple of the key/value heads "
                         f"(GQA/MQA); got Hq={Hq}, Hkv={Hkv} from q.shape={qs}, "
                         f"{k_name}.shape={ks}")
    return Hq, Hkv, qs[-1]


def check_options(*, causal, scale, layout, head_dim):
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} is not one of {LAYOUTS}")
    check_flag("causal", causal)
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a real number or None; got {scale=}")
    scale = float(scale)
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number; got {scale=}")
    return scale


def check_backward_inputs(extra, qs, dtype, lse_shape, lse_dims):
    """``do`` and ``o`` like q (shape ``qs``, ``dtype``), ``lse`` of ``lse_shape``."""
    for name in ("do", "o"):
        s = tuple(int(t) for t in extra[name].shape)
        if s != qs:
            raise ValueError(f"{name} must have q's shape {qs}; got {name}.shape={s}")
        dt = _interop.dtype_name(extra[name])
        if dt != dtype:
            raise TypeError(f"{name} must have q's dtype {dtype}; got {name}.dtype={dt}")
    s = tuple(int(t) for t in extra["lse"].shape)
    if s != lse_shape:
        raise ValueError(f"lse must have shape {lse_dims} = {lse_shape}; got lse.shape={s}")
    dt = _interop.dtype_name(extra["lse"])
    if dt not in ("float32", "float64"):
        raise TypeError("lse must be float32 or float64 (the forward returns float64 for "
                        f"float64 inputs, else float32); got lse.dtype={dt}")


def make_case(q, k, v, *, causal, scale, layout, direction="forward", need_lse=False,
              explicit=False, extra=None, options=None) -> Case:
    """Check q, k, v (and, for the backward pass, ``extra`` = {"do", "o", "lse"}) and
    describe the call. ``options``: the mask and score options by argument name
    (:func:`flashcore._mods.check_mods`), None for plain attention."""
    named = {"q": q, "k": k, "v": v}
    library, device = _arrays({**named, **(extra or {})})
    dtype = _dtype(named)
    if layout not in LAYOUTS:
        raise ValueError(f"{layout=} is not one of {LAYOUTS}")
    qs, ks, vs = (_shape4(n, x, layout) for n, x in named.items())
    head_axis, row_axis = (1, 2) if layout == "bhnd" else (2, 1)
    B, Nq, Nk = qs[0], qs[row_axis], ks[row_axis]
    if ks != vs:
        raise ValueError(f"k and v must have one shape; got k.shape={ks}, v.shape={vs}")
    if ks[0] != B:
        raise ValueError(f"q and k must have one batch size; got q.shape={qs}, k.shape={ks}")
    Hq, Hkv, D = check_heads(qs, ks, head_axis, head_axis)
    scale = check_options(causal=causal, scale=scale, layout=layout, head_dim=D)
    if extra:
        check_backward_inputs(extra, qs, dtype, (B, Hq, Nq), "(B, Hq, Nq)")
    mods, arrays = None, {}
    if options:
        mods = check_mods(**options, library=library, device=device, B=B, Hq=Hq, Nq=Nq, Nk=Nk)
        if mods is not None:
            arrays = {"alibi_slopes": options.get("alibi_slopes"),
                      "mod_args": tuple(options.get("mod_args") or ())}
    return Case(
        library=library, device=device, dtype=dtype, batch=B, heads_q=Hq, heads_kv=Hkv,
        seqlen_q=Nq, seqlen_k=Nk, head_dim=D, causal=bool(causal), scale=scale, layout=layout,
        direction=direction, need_lse=need_lse, explicit=explicit, mods=mods, **arrays,
    )
