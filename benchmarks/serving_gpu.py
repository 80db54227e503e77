"""attnhub.attention_kvcache and attention_varlen through the public API, per backend, on
a GPU: what dispatch picks, how fast each eligible backend is, and what the API's host
path costs over the raw decode op.

    python benchmarks/serving_gpu.py OUT_DIR [--quick]

Writes OUT_DIR/serving.json and prints a table. Decode: B=8, Hq 32 / Hkv 8, D=128, bf16,
Nq=1 against contiguous and paged (page 16, 256) caches of 4K and 32K keys (and softcap
50 + window 4096), TB/s of K/V read; the API with check_indices True (one host
transfer) and False (nothing read, decisions cached), and triton_flash's raw
``decode_attention`` for the host-path difference. Varlen: 16 documents of 128..8K
tokens (64K in all) causal, forward and forward+backward, per backend, against SDPA on
the same documents padded to one batch. Each case is timed with CUDA events over a
fixed number of calls after warm-up; a backend that fails is recorded with its error.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import attnhub


def _time(fn: Callable[[], Any], iters: int) -> float:
    """Milliseconds per call (CUDA events around ``iters`` calls, after 3 warm-ups)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def _eligible(decision: attnhub.Decision) -> list[str]:
    return [c.name for c in decision.candidates if c.eligible]


def decode_cases(quick: bool) -> list[dict[str, Any]]:
    lengths = [4096] if quick else [4096, 32768]
    cases = []
    for n in lengths:
        for page in (None, 16, 256):
            cases.append({"nk": n, "page": page, "options": {"causal": True}})
        cases.append({"nk": n, "page": None, "options": {"softcap": 50.0, "window": (4096, 0)}})
    return cases


def run_decode(case: dict[str, Any], iters: int) -> list[dict[str, Any]]:
    b, hq, hkv, d, nk, page = 8, 32, 8, 128, case["nk"], case["page"]
    dtype, dev = torch.bfloat16, "cuda"
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
    kv_bytes = 2 * b * hkv * nk * d * k.element_size()
    options = case["options"]
    rows = []
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
                ms = _time(call, iters)
                row.update(ms=ms, tb_s=kv_bytes / ms / 1e9)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
    try:  # the raw op: the API's host path is the difference
        from attnhub.backends.triton_flash.decode import decode_attention

        window = options.get("window")
        ms = _time(
            lambda: decode_attention(
                q, k, v, seqlens, block_table=table, scale=1 / math.sqrt(d), window=window,
                softcap=options.get("softcap"), causal=options.get("causal", False),
            ),
            iters,
        )  # fmt: skip
        rows.append({"kind": "decode", **case, "backend": "decode_attention (raw op)",
                     "ms": ms, "tb_s": kv_bytes / ms / 1e9})  # fmt: skip
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
    hq, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to("cuda", torch.int32)
    rows = []
    for train in (False, True):
        q = torch.randn(total, hq, d, device="cuda", dtype=dtype, requires_grad=train)
        k = torch.randn(total, hkv, d, device="cuda", dtype=dtype, requires_grad=train)
        v = torch.randn(total, hkv, d, device="cuda", dtype=dtype, requires_grad=train)
        grad = torch.randn(total, hq, d, device="cuda", dtype=dtype)
        decision = attnhub.explain_varlen(q, k, v, cu, cu, causal=True)

        for name in _eligible(decision):
            if name == "torch_reference":
                continue  # quadratic: 8K-token documents in float32 scores, slow
            row = {"kind": "varlen", "train": train, "docs": n_docs, "tokens": total,
                   "backend": name, "auto": decision.chosen}  # fmt: skip
            call = functools.partial(
                attnhub.attention_varlen, q, k, v, cu, cu, causal=True, backend=name
            )
            try:
                row["ms"] = _time(functools.partial(_step, call, grad if train else None), iters)
            except Exception as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
        # SDPA on the documents padded to one batch (the padding baseline).
        n = int(lengths.max())
        padded = [
            torch.zeros(n_docs, h, n, d, device="cuda", dtype=dtype, requires_grad=train)
            for h in (hq, hkv, hkv)
        ]
        call = functools.partial(
            F.scaled_dot_product_attention, *padded, is_causal=True, enable_gqa=True
        )
        grad_padded = torch.randn(n_docs, hq, n, d, device="cuda", dtype=dtype)
        ms = _time(functools.partial(_step, call, grad_padded if train else None), iters)
        rows.append({"kind": "varlen", "train": train, "docs": n_docs, "tokens": total,
                     "backend": "sdpa padded", "ms": ms})  # fmt: skip
    return rows


def _step(call: Callable[[], torch.Tensor], grad: torch.Tensor | None) -> None:
    """One forward, and the backward where ``grad`` is given."""
    out = call()
    if grad is not None:
        out.backward(grad)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--quick", action="store_true", help="4K decode, 8K-token varlen")
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    rows: list[dict[str, Any]] = []
    for case in decode_cases(args.quick):
        rows += run_decode(case, args.iters)
    rows += run_varlen(args.iters, args.quick)
    meta = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "attnhub": attnhub.__version__, "seconds": round(time.time() - started, 1)}  # fmt: skip
    (args.out / "serving.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    for row in rows:
        what = ", ".join(f"{k}={row[k]}" for k in row if k not in ("ms", "tb_s", "error"))
        result = row.get("error") or (
            f"{row['ms']:.4f} ms" + (f", {row['tb_s']:.2f} TB/s" if "tb_s" in row else "")
        )
        print(f"{what}: {result}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
