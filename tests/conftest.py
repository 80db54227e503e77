"""Fixtures shared by the test modules."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch

from attnhub.request import AttentionRequest

# bfloat16, causal, B=4, 16 query and key heads, Nq = Nk ~ 4096, D = 128, on sm_90.
_CUDA_REQUEST = AttentionRequest(
    device_type="cuda",
    capability=(9, 0),
    dtype=torch.bfloat16,
    batch=4,
    heads_q=16,
    heads_kv=16,
    seqlen_q=4096,
    seqlen_k=4096,
    same_seqlen=True,
    q_longer=False,
    head_dim=128,
    head_dim_v=128,
    causal=True,
)


@pytest.fixture
def cuda_request() -> Callable[..., AttentionRequest]:
    """Builds requests by hand for a faked CUDA device (dispatch reads only the request):
    ``cuda_request(**changes)`` is a bfloat16 causal call, B=4, 16 heads, N~4096, D=128
    on sm_90, with ``changes`` replacing its fields."""

    def build(**changes: Any) -> AttentionRequest:
        return dataclasses.replace(_CUDA_REQUEST, **changes)

    return build


@pytest.fixture
def count_jit_runs(monkeypatch: pytest.MonkeyPatch) -> Callable[..., list[str]]:
    """``count_jit_runs(*kernels)``: a list that gets a Triton kernel's name each time
    its binder runs it (``JITFunction.run``: a launch on the full path, not a cached
    plan's), for the test's duration."""

    def count(*kernels: Any) -> list[str]:
        runs: list[str] = []
        for kernel in kernels:

            def counting(*args: Any, _run: Any = kernel.run, _name: str = kernel.fn.__name__,
                         **kwargs: Any) -> Any:  # fmt: skip
                runs.append(_name)
                return _run(*args, **kwargs)

            monkeypatch.setattr(kernel, "run", counting)
        return runs

    return count


@pytest.fixture
def launched_kernels(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the Triton kernels launched through triton_flash's ``ops._launcher``
    during the test (triton_blocksparse's launches included), in launch order; they
    still run. A replaced launcher means no cached plans (``ops._plan_key``)."""
    from attnhub.backends.triton_flash import ops

    launched: list[str] = []
    launcher = ops._launcher

    def recording(kernel: Any, like: torch.Tensor) -> Any:
        launched.append(kernel.fn.__name__)
        return launcher(kernel, like)

    monkeypatch.setattr(ops, "_launcher", recording)
    return launched


@pytest.fixture
def check_lse_derived_only_when_returned(
    monkeypatch: pytest.MonkeyPatch,
) -> Callable[..., None]:
    """``check(run, inputs, dout, repeats)``: a float mask's call of ``run(leaves,
    return_lse) -> (out, lse)`` (triton_flash's or triton_blocksparse's op) derives its
    lse from the row stats (``ops.lse_of_row_stats``) exactly where it returns one, and
    without it gives the output and gradients of the call with it, bitwise. Each way
    runs ``repeats`` times after the launch plans are cleared (on CUDA the third call
    replays a plan)."""
    from attnhub.backends.triton_flash import ops

    derived: list[int] = []
    lse_of_row_stats = ops.lse_of_row_stats

    def spy(stats: torch.Tensor) -> torch.Tensor:
        derived.append(1)
        return lse_of_row_stats(stats)

    monkeypatch.setattr(ops, "lse_of_row_stats", spy)

    def check(run: Callable[..., Any], inputs: list[torch.Tensor], dout: torch.Tensor,
              repeats: int) -> None:  # fmt: skip
        results = []
        for return_lse in (True, False):
            ops.clear_plans()
            for _ in range(repeats):
                derived.clear()
                leaves = [t.clone().requires_grad_() for t in inputs]
                out, lse = run(leaves, return_lse)
                out.backward(dout)
                assert (lse is not None) is return_lse and len(derived) == int(return_lse)
                results.append([out, *(t.grad for t in leaves)])
        for later in results[1:]:
            for first, got in zip(results[0], later):
                torch.testing.assert_close(got, first, rtol=0, atol=0)

    return check
