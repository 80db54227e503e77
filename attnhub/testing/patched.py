"""Sampled calls of ``F.scaled_dot_product_attention`` under :func:`attnhub.patch`.

The conformance cases (:mod:`attnhub.testing.cases`, :mod:`attnhub.testing.sampled`)
call :func:`attnhub.attention`; a patched model reaches attnhub another way: PyTorch's
arguments (``attn_mask`` of rank 2 to 4 that broadcasts, bool or float; ``is_causal``;
``enable_gqa``), masks whose structure the patch reads (causal either way aligned,
sliding windows, left and right padding, as Hugging Face builds them), and its memo.
:func:`sample_sdpa_calls` draws such calls; :func:`patched_call_problems` runs one
through PyTorch's own function and through the patch, and holds the patched output
and gradients to the float64 reference (:mod:`attnhub.testing.tolerance`'s rule does
not apply: the patch promises PyTorch's behaviour, so PyTorch's own error on the same
call sets the bound, times 3, or the dtype's floor, whichever is larger).

Rows with every key masked are the contract's zeros in the reference; PyTorch's own
kernels may give NaN there, which says nothing of the patch unless it gives NaN too.
Calls that the patch hands to PyTorch's own function give PyTorch's answer even where it
is wrong: on the CPU, ``is_causal`` with ``scale <= 0`` is NaN in PyTorch's kernel (it
masks with -inf before scaling), so such calls are not drawn.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import torch
import torch.nn.functional as F

import attnhub

# Of each dtype: the smallest bound on a patched result's distance from the float64
# reference, relative to 1 + the reference's largest magnitude.
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
_STRUCTURED = ("causal", "window", "padding", "padding_causal")


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """One drawn call of ``F.scaled_dot_product_attention``; :meth:`make` builds its
    tensors (seeded by ``seed``) on a device.

    ``mask``: "none", "random" (bool, kept with probability ``keep``), "float",
    "float_inf" (0 or -inf), "float_min" (0 or the dtype's most negative number, as
    Hugging Face's additive masks hide a key; kept with probability ``keep``), or one of the structured bool masks ("causal", "window",
    "padding", "padding_causal"), aligned top-left (``offset`` 0) or bottom-right
    (``offset`` Nk - Nq), ``width`` keys wide for a window. ``mask_shape``: the
    mask's shape (rank 2 to 4, broadcasting over what it leaves at 1).
    """

    dtype: torch.dtype
    B: int
    Hq: int
    Hkv: int
    Nq: int
    Nk: int
    D: int
    Dv: int
    mask: str = "none"
    mask_shape: tuple[int, ...] = ()
    keep: float = 0.5
    offset: int = 0
    width: int = 0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False
    strided: bool = False
    grad: bool = False
    seed: int = 0

    @property
    def id(self) -> str:
        parts = [str(self.dtype).removeprefix("torch."), f"B{self.B}H{self.Hq}kv{self.Hkv}"]
        parts.append(
            f"N{self.Nq}x{self.Nk}D{self.D}" + (f"v{self.Dv}" if self.Dv != self.D else "")
        )
        if self.mask != "none":
            parts.append(f"{self.mask}{'x'.join(map(str, self.mask_shape))}")
            if self.mask in _STRUCTURED:
                parts.append("br" if self.offset else "tl")
        if self.is_causal:
            parts.append("is_causal")
        if self.scale is not None:
            parts.append(f"scale{self.scale:g}")
        parts += [flag for flag in ("enable_gqa", "strided", "grad") if getattr(self, flag)]
        return "-".join([*parts, f"s{self.seed}"])

    def make(self, device: torch.device | str) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
        """((query, key, value), F.sdpa's keyword arguments) on ``device``."""
        gen = torch.Generator().manual_seed(self.seed)

        def randn(*shape: int) -> torch.Tensor:
            return torch.randn(shape, generator=gen).to(device, self.dtype)

        query = randn(self.B, self.Hq, self.Nq, self.D)
        if self.strided:  # (B, N, H, D) storage, as a model's projection leaves it
            query = query.transpose(1, 2).contiguous().transpose(1, 2)
        key, value = (
            randn(self.B, self.Hkv, self.Nk, self.D),
            randn(self.B, self.Hkv, self.Nk, self.Dv),
        )
        kwargs: dict[str, Any] = {}
        if self.mask != "none":
            kwargs["attn_mask"] = self._mask(gen).to(device)
        if self.is_causal:
            kwargs["is_causal"] = True
        if self.scale is not None:
            kwargs["scale"] = self.scale
        if self.enable_gqa:
            kwargs["enable_gqa"] = True
        return (query, key, value), kwargs

    def _mask(self, gen: torch.Generator) -> torch.Tensor:
        if self.mask == "random":
            return torch.rand(self.mask_shape, generator=gen) < self.keep
        if self.mask == "float":
            return torch.randn(self.mask_shape, generator=gen).to(self.dtype)
        if self.mask in ("float_inf", "float_min"):
            hidden = torch.rand(self.mask_shape, generator=gen) >= self.keep
            fill = float("-inf") if self.mask == "float_inf" else torch.finfo(self.dtype).min
            return torch.zeros(self.mask_shape, dtype=self.dtype).masked_fill(hidden, fill)
        i, j = torch.arange(self.Nq)[:, None], torch.arange(self.Nk)[None, :]
        if self.mask == "causal":
            return (j <= i + self.offset).expand(self.mask_shape)
        if self.mask == "window":
            return ((j <= i + self.offset) & (j > i + self.offset - self.width)).expand(
                self.mask_shape
            )
        lengths = torch.randint(0, self.Nk + 1, (self.B, 1, 1), generator=gen)
        left = bool(torch.randint(0, 2, (), generator=gen))
        keep = j >= self.Nk - lengths if left else j < lengths  # (B, 1, Nk): padding
        if self.mask == "padding_causal":
            keep = keep & (j <= i + self.offset)
        return keep.expand(self.B, self.Nq, self.Nk)[:, None]


def sample_sdpa_calls(device: torch.device | str, count: int, seed: int = 0) -> list[SdpaCall]:
    """``count`` calls drawn for ``device`` ("cuda": head dims 16-128 and half precision
    more often; elsewhere 8-32 and float64 too), reproducible from ``seed``."""
    cuda = torch.device(device).type == "cuda"
    rng = random.Random(seed)
    calls = []
    for n in range(count):
        b, hkv, group = rng.choice([1, 2, 3]), rng.choice([1, 2]), rng.choice([1, 2, 4])
        hq = hkv * group
        nq = rng.choice([1, 2, 4, 16, 17, 64, 129, 200])
        nk = rng.choice([1, 3, 16, 31, 64, 70, 128, 257])
        d = rng.choice([16, 32, 64, 128] if cuda else [8, 16, 32])
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        dtypes += [torch.bfloat16, torch.float16] if cuda else [torch.float64]
        fields: dict[str, Any] = {
            "dtype": rng.choice(dtypes), "B": b, "Hq": hq, "Hkv": hkv, "Nq": nq, "Nk": nk,
            "D": d, "Dv": d if rng.random() < 0.8 else rng.choice([16, 64]),
        }  # fmt: skip
        mask = rng.choice(
            [
                "none",
                "none",
                "random",
                "structured",
                "structured",
                "float",
                "float_inf",
                "float_min",
            ]
        )
        if mask == "structured":
            mask = rng.choice(_STRUCTURED)
            fields["offset"] = rng.choice([0, nk - nq])
            fields["width"] = rng.choice([1, 4, 16, 64]) if mask == "window" else 0
            padded = mask.startswith("padding")
            fields["mask_shape"] = (
                (b, 1, nq, nk) if padded else (1, 1, nq, nk)[4 - rng.choice([2, 4]) :]
            )
        elif mask != "none":
            shape = (rng.choice([1, b]), rng.choice([1, hq]), rng.choice([1, nq]), nk)
            fields["mask_shape"] = shape[4 - rng.choice([2, 3, 4, 4]) :]
            fields["keep"] = rng.choice([0.05, 0.5, 0.9])
        fields["mask"] = mask
        fields["is_causal"] = mask == "none" and rng.random() < 0.5
        if rng.random() < 0.3:
            scale = rng.choice([0.05, 0.5, 2.0, -0.3, 0.0])
            fields["scale"] = scale if scale > 0 or not fields["is_causal"] else 0.5
        fields["enable_gqa"] = hq != hkv or rng.random() < 0.2
        fields["strided"] = rng.random() < 0.2
        fields["grad"] = rng.random() < 0.4
        calls.append(SdpaCall(**fields, seed=seed * 100_003 + n))
    return calls


def _run(
    function: Any, tensors: tuple[torch.Tensor, ...], kwargs: dict[str, Any], grad: bool
) -> Any:
    """("raise", type name, first line) or ("ok", [output, *gradients])."""
    inputs = tuple(t.detach().clone().requires_grad_(grad) for t in tensors)
    try:
        out = function(*inputs, **kwargs)
        results = [out.detach()]
        if grad:
            weight = torch.linspace(-1, 1, out.numel(), device=out.device).view_as(out)
            results += torch.autograd.grad(out, inputs, weight.to(out.dtype))
    except Exception as exc:
        return ("raise", type(exc).__name__, (str(exc).splitlines() or [""])[0][:160])
    return ("ok", results)


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
               is_causal: bool = False, scale: Any = None, enable_gqa: bool = False) -> torch.Tensor:  # fmt: skip
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.double()
    return attnhub.attention(
        query, key, value, attn_mask, causal=is_causal, scale=scale, backend="torch_reference"
    )


def patched_call_problems(
    call: SdpaCall, device: torch.device | str, backend: Any = None
) -> tuple[list[str], dict[str, int]]:
    """What the patched call got wrong (empty: nothing), and the backends that served it
    (:func:`attnhub.stats`). ``backend``: the patch's ``backend=``."""
    tensors, kwargs = call.make(device)
    stock = _run(F.scaled_dot_product_attention, tensors, kwargs, call.grad)
    attnhub.reset_stats()
    with attnhub.patch(backend=backend):
        patched = _run(F.scaled_dot_product_attention, tensors, kwargs, call.grad)
    served = attnhub.stats()
    if stock[0] != patched[0] or (stock[0] == "raise" and stock[1] != patched[1]):
        said = [f"{r[0]} {r[1:] if r[0] == 'raise' else ''}".strip() for r in (stock, patched)]
        return [f"PyTorch: {said[0]}; patched: {said[1]}"], served
    if stock[0] == "raise":
        return [], served
    reference = _run(_reference, tuple(t.double() for t in tensors), kwargs, call.grad)
    if reference[0] == "raise":
        return [f"the reference raised {reference[1:]}"], served
    floor = FLOOR[call.dtype]
    problems = []
    for name, theirs, mine, want in zip(
        ("out", "dq", "dk", "dv"), stock[1], patched[1], reference[1]
    ):
        if not want.numel():  # an empty call: nothing to differ
            continue
        if mine.isnan().any() and not want.isnan().any():
            problems.append(f"{name}: NaN where the reference has none")
            continue
        their_error = float((theirs.double() - want).abs().nan_to_num(0.0).max())
        error = float((mine.double() - want).abs().max())
        magnitude = 1.0 + float(want.abs().max())
        if error > max(3 * their_error, floor * magnitude):
            problems.append(f"{name}: {error:.3g} from the reference, PyTorch's {their_error:.3g}")
    return problems, served
