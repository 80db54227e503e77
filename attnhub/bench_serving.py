"""attnhub.attention_kvcache and attention_varlen through the public API, per backend, on
a GPU: what dispatch picks, how fast each eligible backend is, and what the API's host
path costs over the raw decode op.

    attnhub bench --serving [-o FILE.json] [--quick] [--iters N]   # decode and varlen
    attnhub bench --varlen [-o FILE.json] [--quick] [--iters N]    # varlen only

Writes the JSON (default ``attnhub-serving.json``) and a text table beside it (``.txt``),
and prints the table; needs a CUDA GPU. Decode: B=8, Hq 32 / Hkv 8, D=128, bf16,
Nq=1 against contiguous and paged (page 16, 256) caches of 4K and 32K keys (and softcap
50 + window 4096), TB/s of K/V read; the API with check_indices True (one host
transfer) and False (nothing read, decisions cached), and triton_flash's raw
``decode_attention`` for the host-path difference. Varlen: 16 documents of 128..8K
tokens (64K in all) causal, D=128, heads 32/8 and 32/32 (PyTorch's varlen_attn may take
no GQA), forward and forward+backward, per backend, against PyTorch's varlen_attn called
directly (K/V heads repeated where it takes no GQA) and SDPA on the same documents padded
to one batch. Each case is timed with CUDA events over a
fixed number of calls after warm-up; a backend that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json
import math
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub
from attnhub.timing import event_ms


def _eligible(decision: attnhub.Decision) -> list[str]:
    return [c.name for c in decision.candidates if c.eligible]


def decode_cases(quick: bool) -> list[dict[str, Any]]:
    lengths = [4096] if quick else [4096, 32768]
    cases: list[dict[str, Any]] = []
    for n in lengths:
        for page in (None, 16, 256):
            cases.append({"nk": n, "page": page, "options": {"causal": True}})
        cases.append({"nk": n, "page": None, "options": {"softcap": 50.0, "window": (4096, 0)}})
    return cases


def run_decode(case: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    # The decode bench's serving shape, and its count of the bytes a call must read
    # (imported here: that module imports Triton).
    from .bench_decode import DTYPE, HKV, HQ, B, D, kv_bytes

    b, hq, hkv, d, nk, page = B, HQ, HKV, D, case["nk"], case["page"]
    dtype, dev = DTYPE, "cuda"
    q = torch.randn(b, hq, 1, d, device=dev, dtype=dtype)
    seqlens = torch.full((b,), nk, device=dev, dtype=torch.int32)
    table = None
    if page is None:
        k = torch.randn(b, hkv, nk, d, device=dev, dtype=dtype)
    else:
        per_seq = nk // page
        k = torch.randn(b * per_seq, page, hkv, d, device=dev, dtype=dtype)
        table = torch.randperm(b * per_seq, device=dev).view(b, per_seq).int()
    v = torch.randn_like(k)
    options = case["options"]
    window = options.get("window")
    read = kv_bytes(nk, 1, None if window is None else window[0])
    rows: list[dict[str, Any]] = []
    decision = attnhub.explain_kvcache(q, k, v, seqlens, block_table=table, **options)
    for name in _eligible(decision):
        for checked in (True, False):
            row = {"kind": "decode", **case, "backend": name, "check_indices": checked,
                   "auto": decision.chosen}  # fmt: skip
            try:
                call = functools.partial(
                    attnhub.attention_kvcache, q, k, v, seqlens, block_table=table,
                    backend=name, check_indices=checked, **options,
                )  # fmt: skip
                ms = event_ms(call, iters)
                row.update(ms=ms, tb_s=read / ms / 1e9)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    try:  # the raw op: the API's host path is the difference
        from attnhub.backends.triton_flash.decode import decode_attention

        ms = event_ms(
            lambda: decode_attention(
                q, k, v, seqlens, block_table=table, scale=1 / math.sqrt(d), window=window,
                softcap=options.get("softcap"), causal=options.get("causal", False),
            ),
            iters,
        )  # fmt: skip
        rows.append({"kind": "decode", **case, "backend": "decode_attention (raw op)",
                     "ms": ms, "tb_s": read / ms / 1e9})  # fmt: skip
    except Exception as exc:
        rows.append({"kind": "decode", **case, "backend": "decode_attention (raw op)",
                     "error": f"{type(exc).__name__}: {exc}"[:300]})  # fmt: skip
    return rows


def run_varlen(iters: int, quick: bool) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(0)
    n_docs, total = (4, 8192) if quick else (16, 65536)
    # Lengths 128..8K summing to `total`: log-uniform draws, scaled, the rest to the last.
    raw = torch.exp(torch.empty(n_docs).uniform_(math.log(128), math.log(8192), generator=gen))
    lengths = (raw / raw.sum() * total).long().clamp(128, 8192)
    lengths[-1] += total - int(lengths.sum())
    lengths = lengths.clamp(min=1)
    total = int(lengths.sum())
    d, dtype = 128, torch.bfloat16
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to("cuda", torch.int32)
    rows: list[dict[str, Any]] = []
    # GQA 32/8 (Llama's shape) and MHA 32/32, which PyTorch's varlen_attn serves where
    # its version takes no GQA.
    for (hq, hkv), train in itertools.product(
        ((32, 8), (32, 32))[: 1 if quick else 2], (False, True)
    ):
        case = {"kind": "varlen", "train": train, "docs": n_docs, "tokens": total,
                "heads": f"{hq}/{hkv}"}  # fmt: skip
        q = torch.randn(total, hq, d, device="cuda", dtype=dtype, requires_grad=train)
        k = torch.randn(total, hkv, d, device="cuda", dtype=dtype, requires_grad=train)
        v = torch.randn(total, hkv, d, device="cuda", dtype=dtype, requires_grad=train)
        grad = torch.randn(total, hq, d, device="cuda", dtype=dtype)
        decision = attnhub.explain_varlen(q, k, v, cu, cu, causal=True)

        for name in _eligible(decision):
            if name == "torch_reference":
                continue  # quadratic: 8K-token documents in float32 scores, slow
            row: dict[str, Any] = {**case, "backend": name, "auto": decision.chosen}
            call = functools.partial(
                attnhub.attention_varlen, q, k, v, cu, cu, causal=True, backend=name
            )
            try:
                row["ms"] = event_ms(functools.partial(_step, call, grad if train else None), iters)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
        rows.append(
            {**case, **_raw_varlen_attn(q, k, v, cu, int(lengths.max()), grad, train, iters)}
        )
        # SDPA on the documents padded to one batch (the padding baseline).
        n = int(lengths.max())
        qp, kp, vp = (
            torch.randn(n_docs, h, n, d, device="cuda", dtype=dtype, requires_grad=train)
            for h in (hq, hkv, hkv)
        )
        padded = functools.partial(
            F.scaled_dot_product_attention, qp, kp, vp, is_causal=True, enable_gqa=hq != hkv
        )
        grad_padded = torch.randn(n_docs, hq, n, d, device="cuda", dtype=dtype)
        ms = event_ms(functools.partial(_step, padded, grad_padded if train else None), iters)
        rows.append({**case, "backend": "sdpa padded", "ms": ms})
        del q, k, v, qp, kp, vp
    return rows


def _raw_varlen_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, longest: int,
    grad: torch.Tensor, train: bool, iters: int,
) -> dict[str, Any]:  # fmt: skip
    """PyTorch's varlen_attn called directly, as a user would, whatever attnhub's
    torch_varlen backend accepts: causal through the arguments the installed version has,
    and K/V heads repeated where it takes no GQA (the copy is made before timing)."""
    row: dict[str, Any] = {"backend": "varlen_attn (raw)"}
    try:
        from torch.nn.attention.varlen import varlen_attn
    except Exception as exc:
        return {**row, "error": f"not in this PyTorch: {type(exc).__name__}: {exc}"[:300]}
    names = inspect.signature(varlen_attn).parameters
    kwargs: dict[str, Any] = {}
    if "window_size" in names:
        kwargs["window_size"] = (-1, 0)
    elif "is_causal" in names:
        kwargs["is_causal"] = True
    else:
        return {**row, "error": "varlen_attn takes no causal argument"}
    if q.shape[1] != k.shape[1]:
        if "enable_gqa" in names:
            kwargs["enable_gqa"] = True
        else:
            group = q.shape[1] // k.shape[1]
            k, v = (t.detach().repeat_interleave(group, 1).requires_grad_(train) for t in (k, v))
            row["backend"] = "varlen_attn (raw, K/V heads repeated)"
    call: Callable[[], Any] = functools.partial(
        varlen_attn, q, k, v, cu, cu, longest, longest, **kwargs
    )
    try:
        row["ms"] = event_ms(functools.partial(_step, call, grad if train else None), iters)
    except Exception as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
    return row


def _step(call: Callable[[], Any], grad: torch.Tensor | None) -> None:
    """One forward, and the backward where ``grad`` is given."""
    out = call()
    if grad is not None:
        out.backward(grad)


def table(rows: list[dict[str, Any]]) -> str:
    """One line per row: its case, then the time (and TB/s) or the error."""
    lines = []
    for row in rows:
        what = ", ".join(f"{k}={row[k]}" for k in row if k not in ("ms", "tb_s", "error"))
        result = row.get("error") or (
            f"{row['ms']:.4f} ms" + (f", {row['tb_s']:.2f} TB/s" if "tb_s" in row else "")
        )
        lines.append(f"{what}: {result}")
    return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
    """``attnhub bench --serving`` / ``--varlen`` (see the module docstring)."""
    if not torch.cuda.is_available():
        print("attnhub bench --serving/--varlen: needs a CUDA GPU", file=sys.stderr)
        return 2
    output = pathlib.Path(args.output or "attnhub-serving.json")
    started = time.time()
    rows: list[dict[str, Any]] = []
    if args.serving:
        for case in decode_cases(args.quick):
            rows += run_decode(case, args.iters)
    rows += run_varlen(args.iters, args.quick)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "attnhub": attnhub.__version__, "seconds": round(time.time() - started, 1)}  # fmt: skip
    output.write_text(json.dumps({"kind": "serving", "meta": meta, "rows": rows}, indent=1))
    text = table(rows)
    output.with_suffix(".txt").write_text(text)
    print(text, end="")
    print(f"wrote {output}, {output.with_suffix('.txt')}", file=sys.stderr)
    return 0
