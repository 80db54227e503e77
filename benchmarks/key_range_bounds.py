#!/usr/bin/env python3
"""For the model-size key-range cases that failed on the H200 (gpu-tests-h200.log), the
contract's bound with r_lp as the kit computes it (plain operations in the inputs'
dtype) beside the bound the test used (torch_reference in the inputs' dtype, which
accumulates in float32), on the CPU, for the same inputs; the GPU's error from the log.

The first bound, recomputed here, equals the log's at every case (the inputs are drawn
on the CPU in both runs), which is what makes the second comparable with the GPU's
errors. Output: benchmarks/results/archive/key-range-bounds-cpu-2026-12-02.txt.

    TRITON_INTERPRET=1 PYTHONPATH=. python benchmarks/key_range_bounds.py
"""

from __future__ import annotations

import torch

import attnhub
from attnhub.testing.reference import plain_attention
from attnhub.testing.tolerance import tolerance_bound
from tests import test_key_ranges as t

GPU = {  # (options, d, dtype): {grad: error on the H200}
    ("window", 64, torch.bfloat16): {"dq": 0.0173},
    ("plain", 256, torch.bfloat16): {"dq": 0.00391, "dk": 0.00419},
    ("causal", 256, torch.float16): {"dq": 0.00198},
    ("bottom_right", 64, torch.float16): {"dq": 0.000534},
    ("plain", 256, torch.float16): {"dk": 0.000512},
}
for (options, d, dtype), errors in GPU.items():
    opts = dict(t.OPTIONS[options])
    if options == "window":
        opts["window"] = (300, 40)
    n = 1500
    nq = 700 if options == "bottom_right" else n
    mask = t.padding_mask(4, n, [(0, n), (0, 1023), (477, n), (0, 0)])
    q, k, v = t.inputs(4, 8, 2, nq, n, d, dtype, mask, seed=d)
    clean = [x.nan_to_num(0.0) for x in (q, k, v)]
    g = torch.Generator().manual_seed(7)
    grad = torch.randn((4, 8, nq, d), generator=g).to(dtype)
    grads = {}
    for name, ref_dtype in (("r64", torch.float64), ("old r_lp", dtype), ("plain r_lp", dtype)):
        leaves = [x.to(ref_dtype).requires_grad_() for x in clean]
        if name == "plain r_lp":
            r, _ = plain_attention(*leaves, mask, t._case(q, k, v, opts))
        else:
            r, _ = attnhub.attention(
                *leaves, mask, backend="torch_reference", return_lse=True, **opts
            )
        grads[name] = dict(
            zip(("dq", "dk", "dv"), torch.autograd.grad(r, leaves, grad.to(ref_dtype)))
        )
    for gname, err in errors.items():
        old = tolerance_bound(grads["old r_lp"][gname], grads["r64"][gname])
        new = tolerance_bound(grads["plain r_lp"][gname], grads["r64"][gname])
        print(
            f"{options:12s} D{d} {str(dtype)[6:]:8s} {gname}: H200 error {err:.3g}; bound "
            f"with torch_reference r_lp {old:.3g} (the log's), with the kit's plain r_lp "
            f"{new:.3g}: {'passes' if err <= new else 'FAILS'} ({err / new:.2f}x)",
            flush=True,
        )
