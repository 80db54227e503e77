"""The two references of contract.md's tolerance rule, computed by the kit itself.

``r64`` is the executable contract, ``torch_reference``, run in float64 on upcast
copies of a case's inputs. ``r_lp`` is "the reference computed in the input's dtype by
plain PyTorch operations" (contract.md, Tolerances): :func:`plain_attention` below,
the kit's own code, deliberately not ``torch_reference``. r_lp only sets the width of
the bound (``2 * max|r_lp - r64| + 1e-5``): it stands for the error a straightforward
implementation makes in that dtype, so it must stay straightforward whatever
torch_reference does inside (it may, for instance, accumulate half precision in
float32, which would shrink every bound to a width no kernel is held to), and it must
not depend on the backend under test.

Both are computed from detached copies of the inputs, before the backend is called
(:mod:`attnhub.testing.check`), so a backend that changes its inputs cannot move the
references with them.
"""

from __future__ import annotations

import math

import torch

from .. import mkl_vml
from .cases import Case, Inputs

# Gradient names in the order of Inputs.differentiable().
_GRAD_NAMES = ("dq", "dk", "dv", "dmask")


def case_scale(case: Case) -> float:
    """The case's softmax scale: its ``scale``, or 1 / sqrt(D) when it leaves it out."""
    return case.scale if case.scale is not None else 1.0 / math.sqrt(case.D)


def _kept_positions(case: Case, nq: int, nk: int, device: torch.device) -> torch.Tensor | None:
    """The (Nq, Nk) bool mask that causal and window keep (None: every key).

    Which positions are kept is the contract's definition, not arithmetic whose error
    r_lp stands for: torch_reference's ``keep_mask`` says it, once.
    """
    from attnhub.backends.torch_reference import keep_mask
    from attnhub.request import AttentionParams

    params = AttentionParams(causal=case.causal, alignment=case.alignment, window=case.window)
    return keep_mask(nq, nk, params, device)


def plain_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    case: Case,
) -> tuple[torch.Tensor, torch.Tensor]:
    """contract.md's attention as plain PyTorch operations in the inputs' dtype (r_lp).

    Shapes: query (B, Hq, Nq, D), key (B, Hkv, Nk, D), value (B, Hkv, Nk, Dv),
    attn_mask broadcastable to (B, Hq, Nq, Nk). Returns ``(out, lse)``: out
    (B, Hq, Nq, Dv) in the inputs' dtype and lse (B, Hq, Nq) as float32.

    Every intermediate is a tensor of the inputs' dtype, and the softmax is spelled out
    as its elementary operations (shift by the row maximum, exp, sum, divide), each
    rounding its result to that dtype: the error of a straightforward implementation,
    which is what the bound's width stands for. (This is the arithmetic torch_reference
    had in half precision when the kit's bounds were set; a fused ``torch.softmax``,
    which accumulates in float32 inside, would narrow the fp16 gradient bounds below
    what a plain fp16 implementation meets.) Dropout is not applied: the kit compares
    only calls without it.

    A row whose every score is -inf gives zeros and an lse of -inf, with no NaN
    (0 / 0) in the output or, through autograd, in the gradients.
    """
    group = query.shape[1] // key.shape[1]
    if group > 1:  # query head h reads key/value head h // group
        key = key.repeat_interleave(group, dim=1)
        value = value.repeat_interleave(group, dim=1)
    scores = (query @ key.transpose(-2, -1)) * case_scale(case)
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    keep = _kept_positions(case, query.shape[2], key.shape[2], query.device)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        keep = attn_mask if keep is None else keep & attn_mask
    elif attn_mask is not None:
        if torch.promote_types(scores.dtype, attn_mask.dtype) != scores.dtype:
            # A float32 mask on half-precision scores: the contract adds it to float32
            # scores, so it is added unrounded and the softmax runs in float32 (a
            # rounded mask is an error no implementation may make, not a width).
            scores = scores.to(attn_mask.dtype)
        scores = scores + attn_mask.to(scores.dtype)
    if keep is not None:
        scores = scores.masked_fill(~keep, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True).detach()
    row_max = row_max.masked_fill(~torch.isfinite(row_max), 0.0)  # fully masked rows
    weights = torch.exp(scores - row_max)
    total = weights.sum(dim=-1, keepdim=True)
    empty = total == 0
    safe_total = total.masked_fill(empty, 1.0)
    lse = (torch.log(safe_total) + row_max).masked_fill(empty, float("-inf"))
    return (weights / safe_total).to(value.dtype) @ value, lse.squeeze(-1).float()


def _reference_attention_64(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    case: Case,
) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_reference on float64 tensors: the contract's executable form (r64)."""
    from attnhub.backends.torch_reference import reference_attention
    from attnhub.validation import make_params

    options = {**case.options(), "scale": case_scale(case), "dropout_p": 0.0}
    params = make_params(query, key=key, **options, block_sparse=None)
    return reference_attention(query, key, value, attn_mask, params)


def _results(inputs: Inputs, case: Case, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """out, lse and (for a backward case) the gradients of one reference, computed on
    detached copies of ``inputs`` converted to ``dtype`` (None: r_lp, in the inputs'
    own dtype with :func:`plain_attention`; float64: r64 with torch_reference)."""

    def leaf(t: torch.Tensor | None) -> torch.Tensor | None:
        if t is None:
            return None
        copy = t.detach().clone()
        if dtype is not None and copy.dtype.is_floating_point:
            copy = copy.to(dtype)
        return copy.requires_grad_(t.requires_grad)

    q, k, v, mask = (leaf(t) for t in (inputs.query, inputs.key, inputs.value, inputs.attn_mask))
    assert q is not None and k is not None and v is not None
    attention = plain_attention if dtype is None else _reference_attention_64
    with torch.enable_grad():
        out, lse = attention(q, k, v, mask, case)
        result = {"out": out.detach(), "lse": lse.detach()}
        if case.backward:
            assert inputs.grad_out is not None
            grad_out = inputs.grad_out.detach().clone()
            grad_out = grad_out if dtype is None else grad_out.to(dtype)
            leaves = [t for t in (q, k, v, mask) if t is not None and t.requires_grad]
            outputs, upstream = [out], [grad_out]
            if inputs.grad_lse is not None:  # the lse is float32 in r_lp, float64 in r64
                outputs.append(lse)
                upstream.append(inputs.grad_lse.detach().to(lse.dtype))
            grads = torch.autograd.grad(outputs, leaves, upstream, allow_unused=True)
            grads = tuple(
                torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)
            )
            result.update(zip(_GRAD_NAMES, grads, strict=False))
    return result


def references(
    inputs: Inputs, case: Case
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(r_lp, r64)`` for ``case`` on ``inputs``: dicts with ``out``, ``lse`` and, for
    a backward case, ``dq``, ``dk``, ``dv`` (and ``dmask`` when the mask requires grad).

    Computed from copies, so call it before the backend runs: whatever the backend then
    does to the inputs, the references are those of the inputs as they were drawn.
    """
    if case.dropout_p:
        raise ValueError(
            f"case {case.id}: dropout_p={case.dropout_p} has no deterministic reference; "
            "dropout is checked by attnhub.testing.dropout_problems"
        )
    # The references may be a process's first exp, log or tanh, before any attnhub call
    # has loaded the registry: settle MKL's dispatch first (attnhub.mkl_vml).
    mkl_vml.resolve_dispatch()
    return _results(inputs, case, None), _results(inputs, case, torch.float64)
