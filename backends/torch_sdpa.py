"""Backend "torch": PyTorch's own attention kernels, with flashcore's semantics kept.

``torch.nn.functional.scaled_dot_product_attention`` chooses among FlashAttention-2, cuDNN,
memory-efficient and math kernels. Around it this module keeps what flashcore promises and
SDPA does not:

- bottom-right causal alignment when ``Nq != Nk`` (SDPA's ``is_causal`` is top-left);
- rows that see no key give output 0 and lse ``-inf`` (SDPA gives NaN, or crashes for
  ``Nk = 0``). Under causal masking those rows are exactly the first ``Nq - Nk`` ones, so
  they are cut off before the call and filled afterwards; the remaining ``Nk`` rows form a
  square lower triangle, which every SDPA kernel supports;
- GQA/MQA (``enable_gqa`` where torch has it, else k and v repeated per group);
- both layouts (``"bnhd"`` is read as a transposed view, never copied);
- ``lse``: SDPA does not return it, so ``need_lse`` calls go to the aten kernels that do:
  ``_scaled_dot_product_flash_attention_for_cpu`` on the CPU, and on CUDA
  ``_scaled_dot_product_flash_attention`` (fp16/bf16) or ``_efficient_attention_forward``
  (fp32). float64 on CUDA (and devices other than CPU and CUDA) have no lse: such a call
  is declined in ``supports`` (named explicitly: BackendUnavailableError saying why;
  "auto" moves on), while calls that do not need lse are served.

The backward pass recomputes the forward under torch's autograd and asks it for the
gradients (torch's backward kernels), so it does not depend on the lse handed in.

PyTorch is imported inside functions only: ``import flashcore`` imports no framework.
"""
from __future__ import annotations

import importlib.util

from flashcore import _rules
from flashcore._errors import BackendUnavailableError

NAME = "torch"
#: Head dims the CUDA lse kernels take are padded to a multiple of this (zeros change
#: neither the scores nor the output columns that are kept).
_CUDA_HEAD_ALIGN = 8


def unavailable_reason():
    if importlib.util.find_spec("torch") is None:
        return 'PyTorch is not installed; install it with pip install "flashcore[torch]"'
    return None


def _lse_unavailable(case):
    """Why torch cannot give lse for this case, or None."""
    if case.device == "cpu":
        return None
    if case.on_gpu:
        if case.dtype == "float64":
            return "torch has no CUDA attention kernel that returns lse for float64"
        return None
    return f"torch returns lse only on CPU and CUDA devices; got device {case.device!r}"


def supports(case):
    if case.library != "torch":
        return f"it serves only PyTorch tensors; got {case.library} arrays"
    if case.packed:
        return (
            "varlen and KV-cache calls are not given to SDPA; numba_cpu and reference serve them")
    if case.mods is not None:
        return (f"SDPA is not given {', '.join(case.mods.names())} by flashcore; "
                "numba_cpu and reference compute them")
    if case.direction == "forward" and case.need_lse:
        why = _lse_unavailable(case)
        if why is not None:
            return f"it cannot return lse here: {why}"
    return None


# --- helpers ------------------------------------------------------------------------------


def _torch():
    import torch

    return torch


def _bhnd(x, layout):
    return x if layout == "bhnd" else x.transpose(1, 2)


def _from_bhnd(x, layout):
    return x if layout == "bhnd" else x.transpose(1, 2)


def _has_enable_gqa(torch):
    major, minor = (int(p) for p in torch.__version__.split(".")[:2])
    return (major, minor) >= (2, 5)


def _repeat_kv(x, group):
    """(B, Hkv, N, D) -> (B, Hkv * group, N, D), query head h reading head h // group."""
    if group == 1:
        return x
    B, H, N, D = x.shape
    return x[:, :, None].expand(B, H, group, N, D).reshape(B, H * group, N, D)


# --- the kernels on rows that see at least one key ---------------------------------------


def _sdpa(torch, q, k, v, case):
    """O for (B, Hq, n, D) queries that each see a key: SDPA, kernel of torch's choice."""
    import torch.nn.functional as F

    nq, nk = q.shape[2], k.shape[2]
    kw = {"scale": case.scale}
    if case.causal and nq != nk:
        # Offset > 0 (rows with no key were cut off): a lower-right causal bias, which
        # torch serves with flash / mem-efficient kernels on CUDA and a mask elsewhere.
        from torch.nn.attention.bias import causal_lower_right

        k, v = _repeat_kv(k, case.group), _repeat_kv(v, case.group)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(nq, nk), **kw)
    if case.group > 1:
        if _has_enable_gqa(torch):
            kw["enable_gqa"] = True
        else:
            k, v = _repeat_kv(k, case.group), _repeat_kv(v, case.group)
    return F.scaled_dot_product_attention(q, k, v, is_causal=case.causal, **kw)


def _with_lse_cpu(torch, q, k, v, case):
    nq, nk = q.shape[2], k.shape[2]
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    k, v = _repeat_kv(k, case.group), _repeat_kv(v, case.group)
    if case.causal and nq != nk:
        mask = _rules.additive_mask(torch, nq, nk, True, q.dtype, q.device)
        return op(q, k, v, 0.0, False, attn_mask=mask, scale=case.scale)
    return op(q, k, v, 0.0, case.causal, scale=case.scale)


def _with_lse_cuda(torch, q, k, v, case):
    nq, d = q.shape[2], q.shape[3]
    k, v = _repeat_kv(k, case.group), _repeat_kv(v, case.group)
    pad = (-d) % _CUDA_HEAD_ALIGN
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, pad)) for x in (q, k, v))
    o = lse = None
    if case.dtype in ("float16", "bfloat16") and d + pad <= 256:
        try:
            # torch's flash op reads is_causal as bottom-right when Nq != Nk
            # (torch/nn/attention/bias.py relies on the same).
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, case.causal, False, scale=case.scale)
            o, lse = res[0], res[1]
        except RuntimeError:  # no flash kernel for this GPU: use mem-efficient below
            o = None
    if o is None:
        # custom_mask_type: 0 none, 2 causal from the bottom right. Layout (B, N, H, D).
        res = torch.ops.aten._efficient_attention_forward(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None, None, None,
            None, None, 0.0, 2 if case.causal else 0, True, scale=case.scale)
        o, lse = res[0].transpose(1, 2), res[1][:, :, :nq]
    return (o[..., :d] if pad else o), lse


# --- contract ------------------------------------------------------------------------------


def forward(q, k, v, case):
    """``(o, lse)``; ``lse`` is None unless ``case.need_lse`` (SDPA does not compute it).

    ``o`` stays on torch's autograd graph, so calling this with tensors that require grad
    differentiates through torch's own backward kernels."""
    torch = _torch()
    qb, kb, vb = (_bhnd(x, case.layout) for x in (q, k, v))
    B, Hq, Nq, D = case.batch, case.heads_q, case.seqlen_q, case.head_dim
    skip = _rules.leading_empty_rows(Nq, case.seqlen_k, case.causal)
    if case.need_lse:
        why = _lse_unavailable(case)
        if why is not None:  # (supports() says so first; this is for direct callers)
            raise BackendUnavailableError(
                f"backend 'torch' cannot return lse here: {why}; use backend='auto' or "
                "another backend for return_lse=True / attention_forward")
    lse = None
    lse_dtype = getattr(torch, _rules.lse_dtype(case.dtype))
    if skip == Nq or B == 0:
        o = qb.new_zeros((B, Hq, Nq, D))
        if torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)):
            # Keep o on the graph (zero gradients) without letting a NaN input leak in.
            link = qb.sum() + kb.sum() + vb.sum()
            o = o + torch.where(torch.zeros((), dtype=torch.bool, device=o.device), link, 0)
        if case.need_lse:
            lse = torch.full((B, Hq, Nq), _rules.EMPTY_ROW_LSE, dtype=lse_dtype,
                             device=q.device)
        return _from_bhnd(o, case.layout), lse
    qt = qb[:, :, skip:] if skip else qb
    if case.need_lse:
        run = _with_lse_cpu if case.device == "cpu" else _with_lse_cuda
        o, lse = run(torch, qt, kb, vb, case)
        lse = lse.detach().to(lse_dtype)  # lse is not differentiable (as in FA2)
    else:
        o = _sdpa(torch, qt, kb, vb, case)
    if skip:
        o = torch.cat([o.new_zeros((B, Hq, skip, D)), o], dim=2)
        if lse is not None:
            lse = torch.cat([lse.new_full((B, Hq, skip), _rules.EMPTY_ROW_LSE), lse], dim=2)
    return _from_bhnd(o, case.layout), lse


def backward(do, q, k, v, o, lse, case):
    """Gradients by recomputing the forward with SDPA and pulling ``do`` back through it
    with ``torch.func.vjp`` (torch's backward kernels); ``o`` and ``lse`` are not needed.

    ``torch.func`` rather than ``torch.autograd.grad``: the latter records nothing inside a
    custom op's implementation, which is where flashcore's autograd glue calls this."""
    torch = _torch()
    from dataclasses import replace

    fcase = replace(case, direction="forward", need_lse=False)
    _, pull = torch.func.vjp(lambda a, b, c: forward(a, b, c, fcase)[0],
                             *(x.detach() for x in (q, k, v)))
    return tuple(pull(do))
