"""Dispatch with fake backends and fake devices: choice, reasons, caching, selection.

Requests are built by hand where a device is faked (dispatch reads only the request),
and through ``attnhub.attention`` where the whole path runs on CPU tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import os
import random
import re
import subprocess
import sys
import threading
import typing
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import attnhub
from attnhub import api, dispatch
from attnhub import registry as registry_module
from attnhub.backend import Backend
from attnhub.backends.torch_reference import reference_attention
from attnhub.registry import BackendRegistry
from attnhub.request import OPTION_NAMES, AttentionParams, AttentionRequest


class _Fake(Backend):
    """A backend that records its calls and returns the reference's answer."""

    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    mask_kinds = frozenset({"none", "bool", "float"})
    memory = "linear"
    backward = True

    def __init__(self) -> None:
        self.calls = 0
        self.extra_calls = 0

    def extra_reasons(self, request):  # type: ignore[no-untyped-def]
        self.extra_calls += 1
        return []

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        from attnhub.backends.torch_reference import reference_attention

        self.calls += 1
        out, lse = reference_attention(query, key, value, attn_mask, params)
        return (out, lse) if params.return_lse else out


def fake(name: str, **declarations):  # type: ignore[no-untyped-def]
    """A fresh fake backend class named ``name`` with the given declarations."""
    return type(name.title(), (_Fake,), {"name": name, **declarations})()


@pytest.fixture
def fake_registry(monkeypatch):  # type: ignore[no-untyped-def]
    """Swap the process registry for an empty one; caches are cleared both ways."""
    fresh = BackendRegistry()
    monkeypatch.setattr(registry_module, "_registry", fresh)
    monkeypatch.delenv("ATTNHUB_BACKEND", raising=False)
    monkeypatch.delenv("ATTNHUB_STRICT", raising=False)
    dispatch.clear_cache()
    yield fresh
    dispatch.clear_cache()


@pytest.fixture
def sm80(cuda_request):  # type: ignore[no-untyped-def]
    """A bfloat16 causal call with head_dim 96 on a (faked) sm_80 device."""
    return cuda_request(capability=(8, 0), batch=2, head_dim=96, head_dim_v=96)


def decide(reg: BackendRegistry, request: AttentionRequest, names=None, strict=False):  # type: ignore[no-untyped-def]
    return dispatch._decide(reg, request, dispatch.Selection(names, strict, "test"))


def test_highest_priority_eligible_backend_wins_and_rejections_say_why(fake_registry, sm80):
    fake_registry.add(fake("hopper_only", min_capability=(9, 0), priority=100))
    fake_registry.add(fake("small_heads", head_dims=(16, 64), priority=90))
    fake_registry.add(fake("fp16_only", dtypes=frozenset({torch.float16}), priority=80))
    fake_registry.add(fake("general", priority=10))
    fake_registry.add(fake("slow", priority=50, memory="quadratic"))
    decision = decide(fake_registry, sm80)
    assert decision.chosen == "general"
    reasons = decision.reasons()
    assert reasons["hopper_only"] == ["needs compute capability >= 9.0, device has 8.0"]
    assert reasons["small_heads"] == ["head_dim=96 is not in 16..64"]
    assert reasons["fp16_only"] == ["dtype bfloat16 is not one of float16"]
    # Linear memory ranks above quadratic even at lower priority.
    assert reasons["slow"] == [] and "ranked above slow" in decision.why
    on_hopper = dataclasses.replace(sm80, capability=(9, 0))
    assert decide(fake_registry, on_hopper).chosen == "hopper_only"


def test_reasons_come_from_declarations_for_each_feature(fake_registry, sm80):
    fake_registry.add(fake("plain"))
    request = dataclasses.replace(
        sm80, window=True, softcap=True, dropout=True, heads_kv=4, return_lse=True,
        mask="bool", alignment="bottom_right", same_seqlen=False,
    )  # fmt: skip
    fake_registry.add(
        fake("no_causal", causal_alignments=frozenset(), mask_kinds=frozenset({"none"}))
    )
    reasons = decide(fake_registry, request).reasons()
    assert reasons["plain"] == [
        "grouped-query attention (Hq=16, Hkv=4) is not supported",
        "window (local attention) is not supported",
        "softcap is not supported",
        "dropout_p > 0 is not supported",
        "return_lse=True is not supported",
    ]
    assert "bool attn_mask is not supported (masks: none)" in reasons["no_causal"]
    assert (
        "causal with bottom_right alignment is not supported (no causal at all)"
        in reasons["no_causal"]
    )


def test_choice_does_not_depend_on_registration_order(sm80):
    backends = [fake("alpha", priority=5), fake("beta", priority=5), fake("gamma", priority=1)]
    chosen = set()
    for order in (backends, backends[::-1], [backends[1], backends[2], backends[0]]):
        reg = BackendRegistry()
        for b in order:
            reg.add(b)
        decision = decide(reg, sm80)
        chosen.add((decision.chosen, tuple(c.name for c in decision.candidates)))
    assert chosen == {("alpha", ("alpha", "beta", "gamma"))}


def test_named_backend_that_cannot_serve_raises_with_every_reason(fake_registry):
    fake_registry.add(fake("small_heads", head_dims=(16, 64)))
    fake_registry.add(fake("general"))
    q = torch.randn(1, 2, 8, 96)
    with pytest.raises(attnhub.NoBackendError) as info:
        attnhub.attention(q, q, q, backend="small_heads")
    message = str(info.value)
    assert "q=(1,2,~8,96)" in message and "float32 cpu" in message
    assert "small_heads  head_dim=96 is not in 16..64" in message
    assert "general" in message and "not selected" in message
    assert info.value.reasons["small_heads"] == ["head_dim=96 is not in 16..64"]


def test_unknown_backend_name_is_a_value_error_listing_known_names(fake_registry):
    fake_registry.add(fake("general"))
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends: general"):
        attnhub.attention(q, q, q, backend="nope")
    with pytest.raises(ValueError, match="known backends: general"), attnhub.use_backend("nope"):
        pass


def test_nothing_eligible_raises_no_backend_error(fake_registry):
    fake_registry.add(fake("fp16_only", dtypes=frozenset({torch.float16})))
    q = torch.randn(1, 1, 4, 8)
    with pytest.raises(attnhub.NoBackendError, match="no registered backend can serve"):
        attnhub.attention(q, q, q)
    decision = attnhub.explain(q, q, q)
    assert decision.chosen is None and "fp16_only" in str(decision)


def test_decisions_and_validation_are_cached_per_signature(fake_registry, monkeypatch):
    backend = fake("general")
    fake_registry.add(backend)
    checked = []
    original = api.check_tensors
    monkeypatch.setattr(api, "check_tensors", lambda *a: checked.append(1) or original(*a))
    q = torch.randn(2, 2, 8, 16)
    for _ in range(3):
        attnhub.attention(q, q, q)
    assert (len(checked), backend.extra_calls, backend.calls) == (1, 1, 3)
    attnhub.attention(q, q, q, causal=True)  # a new signature decides again
    attnhub.attention(torch.randn(2, 2, 9, 16), q, q)  # so does a new shape
    assert (len(checked), backend.extra_calls) == (3, 3)


def test_an_explicit_zero_dropout_is_the_default_call(fake_registry, monkeypatch):
    # F.sdpa's and Hugging Face's dropout_p=0.0 is another float object than
    # attention()'s default: it must find the default call's entry, not decide again.
    fake_registry.add(fake("general"))
    checked = []
    original = api.check_tensors
    monkeypatch.setattr(api, "check_tensors", lambda *a: checked.append(1) or original(*a))
    q = torch.randn(2, 2, 8, 16)
    attnhub.attention(q, q, q)
    attnhub.attention(q, q, q, dropout_p=float("0"))
    attnhub.attention(q, q, q, dropout_p=-0.0)
    assert len(checked) == 1
    with pytest.raises(TypeError):
        attnhub.attention(q, q, q, dropout_p=False)  # still validation's to reject


@pytest.mark.parametrize(
    ("valid", "invalid"),
    [
        ({"causal": True}, {"causal": 1}),
        ({}, {"causal": 0}),
        ({}, {"dropout_p": False}),
        ({"return_lse": True}, {"return_lse": 1}),
        ({"scale": 1.0}, {"scale": True}),
        ({"causal": True, "scale": 0.5}, {"causal": 1, "scale": 0.5}),
        ({"scale": 0.5}, {"scale": 0.5, "dropout_p": False}),
        ({"softcap": 1.0}, {"softcap": True}),
        ({"window": (1, 1)}, {"window": (True, 1)}),
        ({"window": (1, 1)}, {"window": (1.0, 1)}),
    ],
    ids=repr,
)
def test_a_rejected_option_never_rides_on_an_equal_cached_one(fake_registry, valid, invalid):
    # True == 1 == 1.0 and False == 0 == 0.0, with equal hashes: the call cache must
    # tell them apart where validation does.
    fake_registry.add(fake("general", window=True, softcap=True, lse=True, dropout=True))
    q = torch.randn(1, 2, 4, 8)
    for _ in range(2):  # decided, then served from the cache
        attnhub.attention(q, q, q, **valid)
    with pytest.raises(TypeError):
        attnhub.attention(q, q, q, **invalid)


@pytest.mark.parametrize(
    "other",
    [
        {"causal": False, "scale": 0.5},
        {"causal": True, "scale": 0.25},
        {"causal": True, "scale": 0.5, "alignment": "bottom_right"},
        {"causal": True, "scale": 0.5, "window": (2, 0)},
        {"causal": True, "scale": 0.5, "softcap": 1.5},
        {"causal": True},
        {"causal": True, "scale": 1},
    ],
    ids=repr,
)
def test_a_call_with_a_float_scale_is_reused_only_with_the_same_options(other):
    """Hugging Face's call (causal and a float scale, every other option at its default)
    is reused only for itself: any other option, or another scale, is another call."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 5, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 7, 8, generator=g, dtype=torch.float64) for _ in range(2))
    hf = {"causal": True, "scale": 0.5}
    # Computed outside dispatch (whose cache is what is tested).
    expected = [
        reference_attention(q, k, v, None, AttentionParams(**{"scale": 8**-0.5, **options}))[0]
        for options in (hf, other)
    ]
    # In a row: the memo of the last call, then the dict, serve the repeats.
    for options, want in ((hf, 0), (hf, 0), (other, 1), (other, 1), (hf, 0)):
        torch.testing.assert_close(attnhub.attention(q, k, v, **options), expected[want])


def test_a_cached_call_does_not_let_a_different_bad_call_through(fake_registry):
    fake_registry.add(fake("general"))
    q = torch.randn(1, 2, 4, 8)
    for _ in range(2):
        attnhub.attention(q, q, q)
    with pytest.raises(ValueError, match="same head dim"):
        attnhub.attention(q, torch.randn(1, 2, 4, 16), q)
    with pytest.raises(ValueError, match="same sequence length"):
        attnhub.attention(q, q, torch.randn(1, 2, 5, 8))
    with pytest.raises(TypeError, match=r"value has dtype torch\.float64"):
        attnhub.attention(q, q, q.double())
    with pytest.raises(ValueError, match="key is on meta"):
        attnhub.attention(q, q.to("meta"), q)
    with pytest.raises(TypeError, match=r"value must be a torch\.Tensor"):
        attnhub.attention(q, q, q.numpy())
    with pytest.raises(ValueError, match="does not broadcast"):
        attnhub.attention(q, q, q, torch.ones(3, 4, dtype=torch.bool))
    for _ in range(2):  # Hugging Face's call, with its float scale
        attnhub.attention(q, q, q, causal=True, scale=0.5)
    with pytest.raises(ValueError, match="scale must be finite, got nan"):
        attnhub.attention(q, q, q, causal=True, scale=float("nan"))
    with pytest.raises(ValueError, match="scale must be at most"):
        attnhub.attention(q, q, q, causal=True, scale=1e39)


def test_a_cached_decision_is_only_reused_for_the_same_request(fake_registry):
    """Layout, grad, mask kind and selection changes after a cached call decide again."""
    contiguous = fake("contiguous_only", priority=10, mask_kinds=frozenset({"none", "bool"}))
    contiguous.extra_reasons = lambda request: (  # type: ignore[method-assign]
        [] if request.last_dim_contiguous else ["strided last dim"]
    )
    no_grad = fake("forward_only", priority=20, backward=False, devices=frozenset({"cpu"}))
    general = fake("general", priority=0)
    for backend in (contiguous, no_grad, general):
        fake_registry.add(backend)

    def served(*args, **kwargs):  # type: ignore[no-untyped-def]
        attnhub.reset_stats()
        attnhub.attention(*args, **kwargs)
        return next(iter(attnhub.stats()))

    q = torch.randn(1, 2, 4, 8)
    strided = torch.randn(1, 2, 8, 4).transpose(-1, -2)  # q's shape, last dim strided
    assert strided.shape == q.shape and strided.stride(-1) != 1
    for _ in range(2):
        assert served(q, q, q) == "forward_only"
    assert served(q, q, q.detach().requires_grad_()) == "contiguous_only"
    assert served(strided, strided, strided, backend=("contiguous_only", "general")) == "general"
    assert served(q, q, q, backend=("contiguous_only", "general")) == "contiguous_only"
    bool_mask, float_mask = torch.ones(4, 4, dtype=torch.bool), torch.zeros(4, 4)
    assert served(q, q, q, bool_mask, backend=("contiguous_only", "general")) == "contiguous_only"
    assert served(q, q, q, float_mask, backend=("contiguous_only", "general")) == "general"
    with attnhub.use_backend("general"):
        assert served(q, q, q) == "general"
    with torch.no_grad():
        assert served(q, q, q.detach().requires_grad_()) == "forward_only"
    assert served(q, q, q) == "forward_only"


def test_the_last_call_memo_checks_metadata_with_pytorch_tensor_guards(fake_registry):
    # Not a correctness test (without the guards every call goes through the dict,
    # correctly, more slowly): where PyTorch's private TensorGuards changed or went away
    # (see api._Guards) this skips with that reason instead of failing CI.
    if not api._Guards._self_check():
        pytest.skip("PyTorch's private TensorGuards is missing or changed: no last-call memo")
    fake_registry.add(fake("general"))
    q, k, v = (torch.randn(1, 2, 4, 8) for _ in range(3))
    attnhub.attention(q, k, v)
    guards = api._last[2]
    # Nq == Nk: PyTorch's check itself (a cache's call, Nq < Nk, gets the length-free
    # wrapper of the same check: test_a_decoding_steps_first_call_takes_the_memo).
    assert type(guards).__name__ == "TensorGuards"
    assert guards.check(q, k, v) and guards.check(*(torch.randn(1, 2, 4, 8) for _ in range(3)))
    assert not guards.check(q, k, v[:, :1])
    assert not guards.check(q, k, k)  # a tensor passed twice: the dict serves that call
    kv = torch.randn(1, 2, 5, 8)
    attnhub.attention(q, kv, kv)  # a new signature, decided with a repeated tensor
    assert api._last[3] is api._NO_CONTEXT  # gets no guards


def test_tensor_guards_leave_out_only_the_dims_they_are_told():
    """Guards.make's ``free``: the size and stride dims named for a tensor pass any value;
    every other dim, and the other tensors, are checked exactly (decode._LastPlan's
    guards of a KV cache that grows by a key each step)."""
    from attnhub.tensor_guards import Guards

    if not Guards._self_check():
        pytest.skip("PyTorch's private TensorGuards is missing or changed: no guards")
    q, cache = torch.randn(2, 4, 1, 8), torch.randn(2, 2, 10, 8)
    guards = Guards.make((q, cache), (None, ((2,), (0, 1))))
    longer = torch.randn(2, 2, 17, 8)
    assert guards.check(q, cache) and guards.check(torch.randn_like(q), longer)
    assert guards.check(q, torch.randn(2, 2, 40, 8)[:, :, :17])  # other dim-0/1 strides
    assert not guards.check(q, torch.randn(3, 2, 10, 8))  # size dim 0
    assert not guards.check(q, torch.randn(2, 2, 10, 16)[..., :8])  # stride dim 2
    assert not guards.check(q, torch.randn(2, 2, 10, 8, dtype=torch.float64))
    assert not guards.check(torch.randn(2, 4, 2, 8), cache)  # q: exact
    assert Guards.make((q, cache), (None, ((4,), ()))) is None  # no dim 4: no guards


def test_sequence_lengths_share_a_decision_within_a_bucket(fake_registry):
    fake_registry.add(fake("general"))
    d1 = attnhub.explain(*(torch.randn(1, 1, 33, 8),) * 3)
    d2 = attnhub.explain(*(torch.randn(1, 1, 60, 8),) * 3)
    assert d1.request == d2.request and d1 is dispatch.decide(d1.request, d1.selection)


def test_a_new_key_length_within_its_bucket_takes_the_decided_call(fake_registry, monkeypatch):
    """A decoding loop's calls differ only in the key length, one key more each step:
    within the length's bucket they take the decided call's decision and runner without
    validating or deciding again, each with its own answer. A new bucket, a length that
    turns Nq == Nk or Nq > Nk, a window (whose sides are unbounded past Nq + Nk) decide
    again, as does a mask of rank < 4; calls that validation refuses still raise."""
    general = fake("general", gqa=True)
    fake_registry.add(general)
    checked = []
    original = api.check_tensors
    monkeypatch.setattr(api, "check_tensors", lambda *a: checked.append(1) or original(*a))
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 2, 8, generator=gen)

    def call(n, mask=None, **options):  # type: ignore[no-untyped-def]
        k, v = (torch.randn(2, 2, n, 8, generator=gen) for _ in "kv")
        out = attnhub.attention(q, k, v, mask, **options)
        params = AttentionParams(scale=8**-0.5, **{"alignment": "top_left", **options})
        as_4d = None if mask is None else mask.view((1,) * (4 - mask.dim()) + tuple(mask.shape))
        want, _ = reference_attention(q, k, v, as_4d, params)
        torch.testing.assert_close(out, want)

    for n in (33, 34, 50, 64):  # bucket 64
        call(n, causal=True, alignment="bottom_right")
    assert (len(checked), general.calls) == (1, 4)
    call(65, causal=True, alignment="bottom_right")  # bucket 128
    assert len(checked) == 2
    for n in (3, 4):  # bucket 4: decided once
        call(n, causal=True, alignment="bottom_right")
    assert len(checked) == 3
    call(2, causal=True, alignment="bottom_right")  # Nq == Nk: another request
    call(1, causal=True, alignment="bottom_right")  # Nq > Nk: another again
    assert len(checked) == 5
    for n in (40, 41):  # a key padding mask of the call's keys
        call(n, torch.rand(2, 1, 1, n, generator=gen) > 0.3)
    assert len(checked) == 6
    for n in (40, 41):  # a window: decided for each length
        call(n, window=(3, None))
    assert len(checked) == 8
    for n in (40, 41):  # a mask of rank < 4 (its 4-D view's shape is in the runner): too
        call(n, torch.rand(1, n, generator=gen) > 0.3)
    assert len(checked) == 10
    with pytest.raises(ValueError, match="same sequence length"):
        attnhub.attention(q, torch.randn(2, 2, 42, 8), torch.randn(2, 2, 43, 8))
    with pytest.raises(ValueError, match="does not broadcast"):
        k = torch.randn(2, 2, 42, 8)
        attnhub.attention(q, k, k, torch.ones(2, 1, 1, 41, dtype=torch.bool))


def test_calls_that_take_a_decision_by_key_length_answer_as_decided_afresh(monkeypatch):
    """Random calls (key lengths in and across buckets, masks of every rank and
    broadcast, causal, alignments, windows, scales, backends) on the real registry: each
    answers, or fails, exactly as the same call decided afresh (no reuse by key length),
    while earlier calls leave their decisions to reuse. A mask of rank < 4 reused by key
    length failed here (its 4-D view's shape was the decided call's)."""
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    real = api._length_free
    reused = 0

    def served(q, k, v, mask, options, reuse):  # type: ignore[no-untyped-def]
        nonlocal reused
        api._call_cache.clear()
        api._last = api._NO_ENTRY
        key = None

        def length_free(call_key):  # type: ignore[no-untyped-def]
            nonlocal key
            key = real(call_key) if reuse else None
            return key

        monkeypatch.setattr(api, "_length_free", length_free)
        hit = False
        try:
            out = attnhub.attention(q, k, v, mask, **options)
            hit = key is not None and key in api._length_free_cache
        except (ValueError, TypeError, attnhub.NoBackendError) as exc:
            out = type(exc).__name__
        reused += hit and reuse
        return out

    for _ in range(400):
        # Mostly bucket 8 (5..8 keys), so that calls often meet an earlier decision.
        nq, nk = rng.choice([1, 1, 2, 5]), rng.choice([5, 6, 7, 8, 5, 6, 7, 8, 1, 9, 17])
        q = torch.randn(2, 4, nq, 8, generator=gen)
        k, v = (torch.randn(2, 2, nk, 8, generator=gen) for _ in "kv")
        mask = None
        if rng.random() < 0.6:
            shape = [rng.choice([1, 2]), rng.choice([1, 4]), rng.choice([1, nq]),
                     rng.choice([1, nk, nk, nk + 1])][rng.choice([0, 0, 1, 2, 3]):]  # fmt: skip
            mask = torch.rand(shape, generator=gen) > 0.3
            if rng.random() < 0.5:
                mask = torch.randn(shape, generator=gen)
        options: dict[str, Any] = {"backend": rng.choice([None, "torch_sdpa", "torch_reference"])}
        if rng.random() < 0.4:
            options["causal"] = True
        if rng.random() < 0.3:
            options["alignment"] = "bottom_right"
        if rng.random() < 0.2:
            options["window"] = (rng.choice([0, 2, None]), rng.choice([0, 3, None]))
        if rng.random() < 0.2:
            options["scale"] = 0.3
        warm = served(q, k, v, mask, options, reuse=True)
        fresh = served(q, k, v, mask, options, reuse=False)
        served(q, k, v, mask, options, reuse=True)  # its decision, for the calls after
        if isinstance(fresh, str) or isinstance(warm, str):
            assert warm == fresh
        else:
            assert torch.equal(warm.nan_to_num(7.0), fresh.nan_to_num(7.0))
    assert reused > 40  # the reuse ran


def test_a_decoding_steps_first_call_takes_the_memo(fake_registry, monkeypatch):
    """An entry of a cache's call (Nq < Nk) decided for its key length's bucket keeps
    guards that leave the key length out (api._LengthFreeGuards; other calls keep
    PyTorch's check alone): a decoding step's first call, one key more, is served by
    the memo in front of the call cache without building a key, each with its own
    answer. A length in another bucket, one that makes Nq == Nk or Nq > Nk, value or
    mask keys other than the key's, a broadcast mask dim given in full, and a key whose
    last stride is not 1 (exact guards) take the call cache instead."""
    general = fake("general", gqa=True)
    fake_registry.add(general)
    keyed = []
    cached = api._cached
    monkeypatch.setattr(api, "_cached", lambda *a: keyed.append(a[1].shape[2]) or cached(*a))
    gen = torch.Generator().manual_seed(0)

    def call(nq, n, mask_keys=None, value_keys=None, key=None):  # type: ignore[no-untyped-def]
        q = torch.randn(2, 4, nq, 8, generator=gen)
        k = torch.randn(2, 2, n, 8, generator=gen) if key is None else key
        v = torch.randn(2, 2, n if value_keys is None else value_keys, 8, generator=gen)
        mask = None if mask_keys is None else torch.rand(2, 1, 1, mask_keys, generator=gen) > 0.3
        out = attnhub.attention(q, k, v, mask)
        want, _ = reference_attention(q, k, v, mask, AttentionParams(scale=8**-0.5))
        torch.testing.assert_close(out, want)

    for n in (33, 34, 35, 64):  # bucket 64, a key padding mask of the call's keys
        call(1, n, mask_keys=n)
    assert keyed == [33]
    call(1, 65, mask_keys=65)  # bucket 128
    call(1, 66, mask_keys=66)
    assert keyed == [33, 65]
    with pytest.raises(ValueError, match="same sequence length"):
        call(1, 67, mask_keys=67, value_keys=68)
    with pytest.raises(ValueError, match="does not broadcast"):
        call(1, 67, mask_keys=66)
    assert keyed == [33, 65, 67, 67]
    keyed.clear()
    for n in (40, 41, 42):  # a mask shared by the keys (key dim 1)
        call(1, n, mask_keys=1)
    call(1, 43, mask_keys=43)  # the key dim in full: another call key
    assert keyed == [40, 43]
    keyed.clear()
    for n in (6, 7, 5, 8):  # Nq = 5: Nq < Nk for 6..8, Nq == Nk at 5 (bucket 8 all)
        call(5, n)
    assert keyed == [6, 5, 8]
    keyed.clear()
    for n in (20, 21):
        call(1, n, key=torch.randn(2, 2, 8, n, generator=gen).transpose(2, 3))
    assert keyed == [20, 21]  # a key of last stride != 1: guards of its shape
    assert type(api._last[2]).__name__ == "TensorGuards"


def test_length_free_guards_shared_by_threads_never_pass_a_mask_of_other_keys(monkeypatch):
    """A check's own key length decides the mask comparison: a thread whose call (mask
    keys other than its keys, refused by validation) is checked while another thread's
    valid call moves the entry's last length must still fail. Once the mask's expected
    key count was the entry's state, and that interleaving passed the refused call to
    the backend (here the other thread's check runs right after this one's length
    update, deterministically)."""
    gen = torch.Generator().manual_seed(0)

    def tensors(n, mask_keys):  # type: ignore[no-untyped-def]
        return (
            torch.randn(2, 4, 1, 8, generator=gen),
            torch.randn(2, 2, n, 8, generator=gen),
            torch.randn(2, 2, n, 8, generator=gen),
            torch.rand(2, 1, 1, mask_keys, generator=gen) > 0.3,
        )

    guards = api._LengthFreeGuards.make(tensors(33, 33))
    assert guards is not None
    other = tensors(40, 40)  # another thread's valid call, same bucket
    takes = api._LengthFreeGuards._takes
    interleaved = []

    def takes_then_other(self, nk):  # type: ignore[no-untyped-def]
        took = takes(self, nk)
        if not interleaved:
            interleaved.append(None)  # once: the other check takes its length here too
            interleaved[0] = guards.check(*other)
        return took

    monkeypatch.setattr(api._LengthFreeGuards, "_takes", takes_then_other)
    assert not guards.check(*tensors(41, 40)[:3], other[3])
    assert interleaved == [True]
    assert guards.check(*tensors(41, 41))


@contextlib.contextmanager
def _api_caches_emptied() -> Iterator[None]:
    """api's memo and call caches empty inside, as they were after."""
    kept = (api._last, dict(api._call_cache), dict(api._length_free_cache))
    api._last = api._NO_ENTRY
    api._call_cache.clear()
    api._length_free_cache.clear()
    try:
        yield
    finally:
        api._last = kept[0]
        api._call_cache.clear()
        api._call_cache.update(kept[1])
        api._length_free_cache.clear()
        api._length_free_cache.update(kept[2])


def test_calls_served_by_the_memo_answer_as_decided_afresh():
    """Random sequences of calls as a decoding loop makes them (key lengths growing by
    one, within and across buckets; now and then a length that flips Nq == Nk or Nq >
    Nk, mismatched value or mask keys, masks of each broadcast, options, backends) on
    the real registry, the memo and caches kept from call to call: each answers, or
    fails, exactly as the same call with every cache and memo emptied."""
    rng = random.Random(1)
    gen = torch.Generator().manual_seed(1)
    served = 0

    def afresh(*args, **options):  # type: ignore[no-untyped-def]
        with _api_caches_emptied():
            return outcome(*args, **options)

    def outcome(*args, **options):  # type: ignore[no-untyped-def]
        try:
            return attnhub.attention(*args, **options)
        except (ValueError, TypeError, attnhub.NoBackendError) as exc:
            return type(exc).__name__

    for _ in range(60):
        nq, n = rng.choice([1, 1, 2, 5]), rng.choice([3, 5, 9, 30, 62])
        options: dict[str, Any] = {"backend": rng.choice([None, "torch_sdpa", "torch_reference"])}
        if rng.random() < 0.4:
            options["causal"] = True
            options["alignment"] = rng.choice(["top_left", "bottom_right"])
        if rng.random() < 0.15:
            options["window"] = (rng.choice([0, 2, None]), rng.choice([0, 3, None]))
        mask_kind = rng.choice([None, "keys", "one", "rows"])
        q = torch.randn(2, 4, nq, 8, generator=gen)
        for _ in range(rng.choice([3, 6, 12])):
            n += rng.choice([1, 1, 1, 1, 0, -1, 2])
            n = max(n, 1)
            k = torch.randn(2, 2, n, 8, generator=gen)
            v = torch.randn(2, 2, n + (rng.random() < 0.05), 8, generator=gen)
            mask_keys = n + (rng.random() < 0.05)
            shape = {None: None, "keys": (2, 1, 1, mask_keys), "one": (1, 1, 1, 1),
                     "rows": (2, 1, nq, mask_keys)}[mask_kind]  # fmt: skip
            mask = None if shape is None else torch.rand(shape, generator=gen) > 0.2
            before = api._last
            warm = outcome(q, k, v, mask, **options)
            served += api._last is before and isinstance(before[2], api._LengthFreeGuards)
            fresh = afresh(q, k, v, mask, **options)
            if isinstance(fresh, str) or isinstance(warm, str):
                assert warm == fresh
            else:
                assert torch.equal(warm.nan_to_num(7.0), fresh.nan_to_num(7.0))
    assert served > 40  # the memo served calls of new key lengths


def test_patched_calls_served_by_the_memo_answer_as_decided_afresh():
    """The patch's memo with length-free guards: random decoding loops of patched
    F.scaled_dot_product_attention calls (key lengths growing by one, in and across
    buckets, now and then mismatched value or mask keys; masks bool or float, per key,
    per row or broadcast; is_causal; enable_gqa) each answer, or fail, exactly as the
    same call with the patch's memos and attnhub's caches emptied."""
    from attnhub import patching

    rng = random.Random(2)
    gen = torch.Generator().manual_seed(2)
    served = 0

    def outcome(*args, **options):  # type: ignore[no-untyped-def]
        try:
            return F.scaled_dot_product_attention(*args, **options)
        except (ValueError, TypeError, RuntimeError) as exc:
            return type(exc).__name__

    def afresh(*args, **options):  # type: ignore[no-untyped-def]
        memos = [(m, m.value, m.masked) for m in patching._memos]
        for m, _, _ in memos:
            m.value, m.masked = patching._NO_VALUE, patching._NO_MASKED
        try:
            with _api_caches_emptied():
                return outcome(*args, **options)
        finally:
            for m, value, masked in memos:
                m.value, m.masked = value, masked

    before = set(patching._memos)  # memos of patches other tests left alive
    with attnhub.patch():
        (memo,) = [m for m in patching._memos if m not in before]
        for _ in range(50):
            nq, n = rng.choice([1, 1, 3]), rng.choice([3, 9, 30, 62])
            gqa = rng.random() < 0.3
            options: dict[str, Any] = {"is_causal": rng.random() < 0.3, "enable_gqa": gqa}
            mask_kind = rng.choice([None, "keys", "one", "rows"])
            float_mask = rng.random() < 0.4
            q = torch.randn(2, 4, nq, 8, generator=gen)
            for _ in range(rng.choice([3, 6, 12])):
                n = max(n + rng.choice([1, 1, 1, 1, 0, -1, 2]), 1)
                heads = 2 if gqa else 4
                k = torch.randn(2, heads, n, 8, generator=gen)
                v = torch.randn(2, heads, n + (rng.random() < 0.05), 8, generator=gen)
                keys = n + (rng.random() < 0.05)
                shape = {None: None, "keys": (2, 1, 1, keys), "one": (1, 1, 1, 1),
                         "rows": (2, 1, nq, keys)}[mask_kind]  # fmt: skip
                mask = None
                if shape is not None:
                    mask = torch.rand(shape, generator=gen)
                    mask = mask.log() if float_mask else mask > 0.2
                call_options = dict(options, is_causal=options["is_causal"] and mask is None)
                # Value rows other than the keys': attnhub refuses the call, and
                # PyTorch's CPU kernel, which then serves it, reads past the keys'
                # scores (its answer changes from call to call): only the outcome's
                # kind is compared.
                valid = v.shape[2] == n
                before = memo.value[1]
                warm = outcome(q, k, v, mask, **call_options)
                served += (
                    valid
                    and memo.value[1] is before
                    and before is not None
                    and isinstance(before[2], api._LengthFreeGuards)
                )
                fresh = afresh(q, k, v, mask, **call_options)
                if isinstance(fresh, str) or isinstance(warm, str):
                    assert warm == fresh
                elif valid:
                    assert torch.equal(warm.nan_to_num(7.0), fresh.nan_to_num(7.0))
                else:
                    assert warm.shape == fresh.shape
    assert served > 30  # the memo served calls of new key lengths


def test_use_backend_restricts_orders_and_is_thread_local(fake_registry):
    fake_registry.add(fake("first", priority=10))
    fake_registry.add(fake("second", priority=5))
    q = torch.randn(1, 1, 4, 8)
    assert attnhub.explain(q, q, q).chosen == "first"
    seen_in_thread = []
    with attnhub.use_backend("second", "first"):
        assert attnhub.explain(q, q, q).chosen == "second"
        thread = threading.Thread(
            target=lambda: seen_in_thread.append(attnhub.explain(q, q, q).chosen)
        )
        thread.start()
        thread.join()
        # An explicit argument overrides the context.
        assert attnhub.explain(q, q, q, backend="first").chosen == "first"
    assert seen_in_thread == ["first"]
    assert attnhub.explain(q, q, q).chosen == "first"


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((), {"strict": "no"}, "strict must be a bool, got 'no'"),
        ((), {"strict": 1}, "strict must be a bool, got 1"),
        ((1,), {}, "use_backend's names must be None, a backend name or a sequence of names, got 1"),
        ((b"first",), {}, "got b'first'"),
        (({"first", "second"},), {}, "got {"),  # a set has no order to restrict by
        (([],), {}, "got []"),
        ((("first", ["second"]),), {}, "got ('first', ['second'])"),
    ],
)  # fmt: skip
def test_use_backend_takes_what_backend_takes_and_a_bool_strict(
    fake_registry, args, kwargs, message
):
    fake_registry.add(fake("first"))
    fake_registry.add(fake("second"))
    with pytest.raises(TypeError, match=re.escape(message)), attnhub.use_backend(*args, **kwargs):
        pass


def test_use_backend_accepts_names_sequences_and_strict_alone(fake_registry):
    fake_registry.add(fake("first", priority=10))
    fake_registry.add(fake("second", priority=5))
    q = torch.randn(1, 1, 4, 8)
    with attnhub.use_backend(["second"], ("first",)):
        assert attnhub.explain(q, q, q).chosen == "second"
    with attnhub.use_backend(strict=True):
        assert attnhub.explain(q, q, q).selection.strict


def test_empty_inputs_without_the_reference_are_refused_clearly(fake_registry):
    fake_registry.add(fake("general"))
    empty = torch.randn(1, 1, 0, 8)
    with pytest.raises(
        attnhub.NoBackendError, match="empty inputs are served by torch_reference alone"
    ):
        attnhub.attention(empty, empty, empty)
    fake_registry.add(fake("torch_reference", memory="quadratic"))
    assert attnhub.explain(empty, empty, empty).chosen == "torch_reference"


def test_environment_variable_selects_process_wide(fake_registry, monkeypatch):
    fake_registry.add(fake("first", priority=10))
    second = fake("second", priority=5)
    fake_registry.add(second)
    q = torch.randn(1, 1, 4, 8)
    monkeypatch.setenv("ATTNHUB_BACKEND", "second")
    attnhub.attention(q, q, q)
    assert second.calls == 1
    assert attnhub.explain(q, q, q).selection.source == "ATTNHUB_BACKEND"
    monkeypatch.delenv("ATTNHUB_BACKEND")
    assert attnhub.explain(q, q, q).chosen == "first"


def test_fallback_to_reference_is_logged_once_and_strict_mode_raises(fake_registry, caplog):
    fake_registry.add(fake("torch_reference", priority=-100, memory="quadratic", window=True))
    fake_registry.add(fake("fast", priority=10))
    q = torch.randn(1, 1, 4, 8)
    with caplog.at_level(logging.INFO, logger="attnhub"):
        for _ in range(3):
            attnhub.attention(q, q, q, window=(1, 1))
    fallbacks = [r for r in caplog.records if "falling back to torch_reference" in r.getMessage()]
    assert len(fallbacks) == 1 and fallbacks[0].levelno == logging.WARNING
    assert "window (local attention) is not supported" in fallbacks[0].getMessage()
    with (
        pytest.raises(attnhub.NoBackendError, match="strict mode"),
        attnhub.use_backend(strict=True),
    ):
        attnhub.attention(q, q, q, window=(1, 1))
    # Naming the reference explicitly is a choice, not a fallback.
    with attnhub.use_backend("torch_reference", strict=True):
        attnhub.attention(q, q, q, window=(1, 1))


def test_explain_table_lists_every_backend_and_why_the_winner_won(fake_registry):
    fake_registry.add(fake("winner", priority=3))
    fake_registry.add(fake("runner_up", priority=2))
    fake_registry.add(fake("rejected", dtypes=frozenset({torch.float64})))
    q = torch.randn(1, 1, 4, 8)
    text = str(attnhub.explain(q, q, q))
    lines = text.splitlines()
    assert lines[0].startswith("attention(q=(1,1,~4,8)")
    assert any("winner" in line and "CHOSEN" in line for line in lines)
    assert any("runner_up" in line and "eligible #2" in line for line in lines)
    assert any(
        "rejected" in line and "dtype float32 is not one of float64" in line for line in lines
    )
    assert lines[-1] == (
        "chosen: winner (linear memory, priority 3; ranked above runner_up by declared priority)"
    )


def test_a_ranking_policy_can_replace_the_declared_priority(fake_registry):
    fake_registry.add(fake("high", priority=10))
    fake_registry.add(fake("low", priority=1))

    class Reverse:
        name = "reverse priority"

        def rank(self, request, eligible):  # type: ignore[no-untyped-def]
            return [(b, "measured") for b in sorted(eligible, key=lambda b: b.priority)]

    q = torch.randn(1, 1, 4, 8)
    attnhub.set_policy(Reverse())
    try:
        decision = attnhub.explain(q, q, q)
        assert decision.chosen == "low" and decision.policy == "reverse priority"
    finally:
        attnhub.set_policy(None)
    assert attnhub.explain(q, q, q).chosen == "high"


def test_torch_compile_traces_dispatch_without_graph_break():
    q, k, v = (torch.randn(1, 2, 16, 32) for _ in range(3))

    def f(q, k, v):  # type: ignore[no-untyped-def]
        return attnhub.attention(q, k, v, causal=True) * 2

    explanation = torch._dynamo.explain(f)(q, k, v)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(f, fullgraph=True, backend="eager")
    torch.testing.assert_close(compiled(q, k, v), f(q, k, v))


def test_import_changes_nothing_and_loads_no_optional_library():
    code = (
        "import sys, torch; flags = (torch.backends.cuda.matmul.allow_tf32,"
        " torch.get_float32_matmul_precision());"
        "import attnhub, attnhub.registry as r;"
        "assert r._registry is None, 'registry loaded at import';"
        "assert flags == (torch.backends.cuda.matmul.allow_tf32,"
        " torch.get_float32_matmul_precision());"
        "assert not {'triton', 'xformers', 'transformers'} & set(sys.modules), sys.modules.keys()"
    )
    result = subprocess.run(
        [sys.executable, "-W", "error", "-c", code], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("command", [["info"], ["explain", "--shape", "2,4,64,32", "--causal"]])
def test_command_line(command):
    env = {**os.environ, "ATTNHUB_DISABLE_PLUGIN_AUTOLOAD": "1"}
    result = subprocess.run(
        [sys.executable, "-m", "attnhub", *command], capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr
    assert "torch_reference" in result.stdout and "torch_sdpa" in result.stdout
    if command[0] == "explain":
        assert "chosen: torch_sdpa" in result.stdout
    else:
        assert "available here" in result.stdout and "declared capabilities" in result.stdout


def test_info_reports_failed_and_skipped_plugins(fake_registry, capsys):
    from attnhub import cli
    from attnhub.registry import PluginFailure, PluginSkip

    fake_registry.add(fake("general"))
    fake_registry.failures.append(
        PluginFailure("broken", "attnhub-broken", "ImportError: No module named 'cuda_kernels'")
    )
    fake_registry.skipped.append(
        PluginSkip("muted", "attnhub-muted", "blocked by ATTNHUB_DISABLE_PLUGINS")
    )
    assert cli.main(["info"]) == 0
    out = capsys.readouterr().out
    assert "general" in out and "available here" in out
    assert (
        "  broken (distribution attnhub-broken): ImportError: No module named 'cuda_kernels'" in out
    )
    assert "  muted (distribution attnhub-muted): blocked by ATTNHUB_DISABLE_PLUGINS" in out


# -- issue 18: backend code runs contained; caches follow the registry; environment ------


def _raise(message):  # type: ignore[no-untyped-def]
    def method(self, *args):  # type: ignore[no-untyped-def]
        raise RuntimeError(message)

    return method


def _returning(value):  # type: ignore[no-untyped-def]
    return lambda self, *args: value


@pytest.mark.parametrize(
    ("method", "impl", "reason"),
    [
        ("extra_reasons", _raise("probe exploded"), "extra_reasons raised RuntimeError: probe exploded"),
        ("extra_reasons", _returning(None), "extra_reasons returned None, not a list of str"),
        ("extra_reasons", _returning("too long"), "extra_reasons returned 'too long', not a list of str"),
        ("extra_reasons", _returning([1]), "extra_reasons returned [1], not a list of str"),
        ("memory_class", _raise("no idea"), "memory_class raised RuntimeError: no idea"),
        ("memory_class", _returning("constant"), "memory_class returned 'constant', not one of ('linear', 'quadratic')"),
        ("unavailable_reason", _raise("driver"), "availability probe raised RuntimeError: driver"),
        ("unavailable_reason", _returning(42), "unavailable_reason returned 42, not a str or None"),
        ("prepare", _raise("no launch config"), "prepare raised RuntimeError: no launch config"),
        ("prepare", _returning(None), "prepare returned None, not a callable"),
    ],
    ids=lambda v: v if isinstance(v, str) and " " not in v else None,
)  # fmt: skip
def test_a_backend_whose_code_fails_is_disabled_and_the_others_serve(
    fake_registry, capsys, method, impl, reason
):
    broken = type("Broken", (_Fake,), {"name": "broken", "priority": 100, method: impl})()
    fake_registry.add(broken)
    fake_registry.add(fake("general", priority=1))
    fake_registry.add(fake("torch_reference", priority=-100, memory="quadratic"))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    # Default calls, named calls of another backend, and explain all work.
    torch.testing.assert_close(attnhub.attention(q, k, v), expected)
    torch.testing.assert_close(attnhub.attention(q, k, v, backend="torch_reference"), expected)
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "general"
    assert decision.reasons()["broken"] == [f"unavailable: {reason}"]
    assert broken.calls == 0
    # Named, the broken backend is refused with its reason, never replaced.
    with pytest.raises(attnhub.NoBackendError, match=re.escape(reason)):
        attnhub.attention(q, k, v, backend="broken")
    # attnhub info says so.
    from attnhub import cli

    assert cli.main(["info"]) == 0
    assert f"no: {reason}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("later", "reason"),
    [
        (RuntimeError("config gone"), "priority raised RuntimeError: config gone"),
        (float("nan"), "priority returned nan, not a finite int or float"),
        ("high", "priority returned 'high', not a finite int or float"),
    ],
)
def test_a_priority_that_breaks_after_registration_disables_only_its_backend(
    fake_registry, later, reason
):
    """Registration checks the priority, but ranking reads it again at every decision: a
    property that raises (or turns into a non-number) later failed every call, the
    declared-priority fallback included."""

    def priority(self):  # type: ignore[no-untyped-def]
        if not self.registered:
            return 100
        if isinstance(later, Exception):
            raise later
        return later

    broken = type("Late", (_Fake,), {"name": "late", "registered": False,
                                     "priority": property(priority)})()  # fmt: skip
    fake_registry.add(broken)
    broken.registered = True
    fake_registry.add(fake("general", priority=1))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    torch.testing.assert_close(
        attnhub.attention(q, k, v), torch.nn.functional.scaled_dot_product_attention(q, k, v)
    )
    decision = attnhub.explain(q, k, v)
    assert decision.chosen == "general"
    assert decision.reasons()["late"] == [f"unavailable: {reason}"]
    assert broken.calls == 0


def _answering(make):  # type: ignore[no-untyped-def]
    """A forward that computes the right answer, then returns ``make(out, lse, query)``."""

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        from attnhub.backends.torch_reference import reference_attention

        self.calls += 1
        out, lse = reference_attention(query, key, value, attn_mask, params)
        return make(out, lse, query)

    return forward


_WRONG_RESULTS = [
    # (what forward returns: out, lse, query -> result; return_lse; the reason's words)
    (lambda o, lse, q: None, False, "returned NoneType None as its output, not a tensor"),
    (lambda o, lse, q: o[..., :1], False, "returned an output of shape (1, 2, 6, 1), not (1, 2, 6, 8)"),
    (lambda o, lse, q: o.double(), False, "returned a torch.float64 output, not torch.float32"),
    (lambda o, lse, q: o.to("meta"), False, "returned its output on meta, not cpu"),
    (lambda o, lse, q: (o, lse), False, "returned tuple (tensor("),
    (lambda o, lse, q: o, True, "returned a tensor, not (output, lse)"),
    (lambda o, lse, q: (o, lse.half()), True, "returned a torch.float16 lse, not torch.float32"),
    (lambda o, lse, q: (o, lse[..., 0]), True, "returned an lse of shape (1, 2), not (1, 2, 6)"),
]  # fmt: skip


@pytest.mark.parametrize(("make", "return_lse", "reason"), _WRONG_RESULTS)
def test_a_plugin_whose_forward_returns_the_wrong_thing_is_disabled_and_the_call_served_again(
    fake_registry, make, return_lse, reason
):
    """A broken plugin breaks nothing but itself: its wrong result never reaches the
    caller; attention() serves the call again, the patched F.sdpa hands it to PyTorch."""
    broken = type("Broken", (_Fake,), {"name": "broken", "priority": 100, "lse": True,
                                       "forward": _answering(make)})()  # fmt: skip
    fake_registry.add(broken)
    fake_registry.add(fake("general", priority=1, lse=True))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    got = attnhub.attention(q, k, v, return_lse=return_lse)
    torch.testing.assert_close(got[0] if return_lse else got, expected)
    assert broken.calls == 1
    why = fake_registry.unavailable_reason("broken")
    assert why is not None and why.startswith("forward ") and reason in why
    assert attnhub.explain(q, k, v).chosen == "general"
    with pytest.raises(attnhub.NoBackendError, match=re.escape(reason)):
        attnhub.attention(q, k, v, backend="broken")


def test_the_patched_function_hands_a_broken_plugins_call_to_pytorch(fake_registry):
    broken = type("Broken", (_Fake,), {"name": "broken", "priority": 100,
                                       "forward": _answering(lambda o, lse, q: o[..., :1])})()  # fmt: skip
    fake_registry.add(broken)
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    with attnhub.patch(backend="broken"):
        got = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(got, expected)
    assert broken.calls == 1
    assert "returned an output of shape" in (fake_registry.unavailable_reason("broken") or "")


def test_a_plugin_that_changes_its_inputs_in_place_raises_and_is_disabled(fake_registry):
    def scribble(out, lse, query):  # type: ignore[no-untyped-def]
        query.mul_(2)
        return out

    broken = type("Broken", (_Fake,), {"name": "broken", "priority": 100, "forward": _answering(scribble)})()  # fmt: skip
    fake_registry.add(broken)
    fake_registry.add(fake("general", priority=1))
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))
    with pytest.raises(attnhub.BrokenBackendError, match="changed its inputs in place") as raised:
        attnhub.attention(q, k, v)
    assert (raised.value.backend, raised.value.inputs_intact) == ("broken", False)
    assert attnhub.explain(q, k, v).chosen == "general"


def test_built_in_runners_are_not_checked_call_by_call():
    """The per-call check is for third-party backends: the built-ins' hot path (the
    conformance suite holds them to the contract) keeps its runner as prepared."""
    from attnhub import api

    q = torch.randn(1, 2, 32, 8)
    for name in ("torch_sdpa", "torch_reference"):
        attnhub.attention(q, q, q, backend=name)
        assert "output_check" not in api._last[1].__qualname__
    broken_module = type("Elsewhere", (_Fake,), {"name": "elsewhere"})()
    assert not dispatch.built_in(broken_module)


def test_a_ranking_policy_that_fails_falls_back_to_declared_priority(fake_registry, caplog):
    fake_registry.add(fake("high", priority=10))
    fake_registry.add(fake("low", priority=1))

    class Raises:
        name = "raises"

        def rank(self, request, eligible):  # type: ignore[no-untyped-def]
            raise KeyError("no table")

    class Drops:
        name = "drops"

        def rank(self, request, eligible):  # type: ignore[no-untyped-def]
            return [(b, "kept") for b in eligible if b.name == "low"]

    q = torch.randn(1, 1, 4, 8)
    try:
        for policy, problem in ((Raises(), "raised KeyError"), (Drops(), "ranked ['low']")):
            attnhub.set_policy(policy)
            decision = attnhub.explain(q, q, q)
            assert decision.chosen == "high"
            assert problem in decision.policy and decision.policy.startswith("declared priority")
            assert any(problem in r.getMessage() for r in caplog.records)
            attnhub.attention(q, q, q)
    finally:
        attnhub.set_policy(None)


def test_the_reference_ranks_last_unless_named_and_strict_refuses_only_what_needs_it(
    fake_registry, caplog
):
    # A policy that puts the reference first (a cost table timing it fastest did).
    class ReferenceFirst:
        name = "reference first"

        def rank(self, request, eligible):  # type: ignore[no-untyped-def]
            return sorted(
                ((b, "fast") for b in eligible), key=lambda p: p[0].name != "torch_reference"
            )

    fake_registry.add(fake("torch_reference", priority=-100, memory="quadratic", window=True))
    fake_registry.add(fake("slow_quadratic", priority=-200, memory="quadratic"))
    q = torch.randn(1, 1, 4, 8)
    attnhub.set_policy(ReferenceFirst())
    try:
        with caplog.at_level(logging.WARNING, logger="attnhub"), attnhub.use_backend(strict=True):
            decision = attnhub.explain(q, q, q)
            assert (decision.chosen, decision.fallback) == ("slow_quadratic", False)
            attnhub.attention(q, q, q)  # servable: strict mode serves it
            # Only the reference can serve a window: that is what strict refuses.
            with pytest.raises(attnhub.NoBackendError, match="strict mode"):
                attnhub.attention(q, q, q, window=(1, 1))
        assert not any("no other backend" in r.getMessage() for r in caplog.records)
        # Named first, the reference is a choice, not a fallback, even in strict mode.
        with attnhub.use_backend("torch_reference", "slow_quadratic", strict=True):
            assert attnhub.explain(q, q, q).chosen == "torch_reference"
            attnhub.attention(q, q, q)
        with (
            attnhub.use_backend("slow_quadratic", "torch_reference", strict=True),
            pytest.raises(attnhub.NoBackendError, match="strict mode"),
        ):
            attnhub.attention(q, q, q, window=(1, 1))
    finally:
        attnhub.set_policy(None)


def test_registry_changes_after_first_use_reach_every_cache(fake_registry):
    first = fake("first", priority=10)
    fake_registry.add(first)
    fake_registry.add(fake("second", priority=5))
    q = torch.randn(1, 2, 33, 8)
    for _ in range(2):  # decided, then served from the call cache
        attnhub.attention(q, q, q)
    assert first.calls == 2
    fake_registry.remove("first")
    attnhub.reset_stats()
    attnhub.attention(q, q, q)  # same signature: the call cache must not serve "first"
    other = torch.randn(1, 2, 60, 8)  # same length bucket: the decision cache neither
    attnhub.attention(other, other, other)
    assert attnhub.stats() == {"second": 2} and first.calls == 2
    decision = attnhub.explain(q, q, q)
    assert decision.chosen == "second" and "first" not in decision.reasons()
    newcomer = fake("newcomer", priority=99)
    fake_registry.add(newcomer)  # added after use: ranks first at once
    attnhub.attention(q, q, q)
    assert newcomer.calls == 1 and attnhub.explain(q, q, q).chosen == "newcomer"
    with pytest.raises(
        ValueError, match=r"unknown backend 'first'; known backends: newcomer, second"
    ):
        fake_registry.remove("first")


@pytest.mark.parametrize("value", ["0", "false", "no", "off", "FALSE", " No ", "Off", ""])
def test_strict_off_values_keep_the_fallback(fake_registry, monkeypatch, value):
    fake_registry.add(fake("torch_reference", priority=-100, memory="quadratic", window=True))
    fake_registry.add(fake("fast", priority=10))
    monkeypatch.setenv("ATTNHUB_STRICT", value)
    q = torch.randn(1, 1, 4, 8)
    attnhub.attention(q, q, q, window=(1, 1))  # served by the reference, not refused


@pytest.mark.parametrize("value", ["1", "true", "yes", "on", "TRUE", " Yes "])
def test_strict_on_values_refuse_the_fallback(fake_registry, monkeypatch, value):
    fake_registry.add(fake("torch_reference", priority=-100, memory="quadratic", window=True))
    fake_registry.add(fake("fast", priority=10))
    monkeypatch.setenv("ATTNHUB_STRICT", value)
    q = torch.randn(1, 1, 4, 8)
    attnhub.attention(q, q, q)  # servable without the reference
    with pytest.raises(attnhub.NoBackendError, match="strict mode"):
        attnhub.attention(q, q, q, window=(1, 1))


@pytest.mark.parametrize("value", ["banana", "2", "enabled", "t"])
def test_strict_garbage_is_an_error_naming_the_variable(fake_registry, monkeypatch, value):
    fake_registry.add(fake("fast", priority=10))
    monkeypatch.setenv("ATTNHUB_STRICT", value)
    q = torch.randn(1, 1, 4, 8)
    for _ in range(2):  # never cached as if it parsed
        with pytest.raises(
            ValueError,
            match=rf"ATTNHUB_STRICT='{value}' is not a boolean: use 1, true, yes, on .* 0, false, no, off",
        ):
            attnhub.attention(q, q, q)


@pytest.mark.parametrize("value", [",,,", " , ", ""])
def test_backend_variable_naming_nothing_restricts_nothing(fake_registry, monkeypatch, value):
    fake_registry.add(fake("first", priority=10))
    monkeypatch.setenv("ATTNHUB_BACKEND", value)
    q = torch.randn(1, 1, 4, 8)
    attnhub.attention(q, q, q)
    assert attnhub.explain(q, q, q).chosen == "first"


def test_backend_variable_names_are_stripped_and_unknown_ones_name_the_variable(
    fake_registry, monkeypatch
):
    fake_registry.add(fake("first", priority=10))
    fake_registry.add(fake("second", priority=5))
    q = torch.randn(1, 1, 4, 8)
    monkeypatch.setenv("ATTNHUB_BACKEND", " second ,, first ,")
    assert attnhub.explain(q, q, q).chosen == "second"
    monkeypatch.setenv("ATTNHUB_BACKEND", "second,nope")
    with pytest.raises(
        ValueError,
        match=r"ATTNHUB_BACKEND='second,nope' names unknown backend 'nope'; known backends: first, second",
    ):
        attnhub.attention(q, q, q)


def test_environment_values_are_parsed_once_per_raw_value(fake_registry, monkeypatch):
    from attnhub import env

    fake_registry.add(fake("first", priority=10))
    monkeypatch.setenv("ATTNHUB_STRICT", " yES  ")  # a raw value no other test uses
    q = torch.randn(1, 1, 4, 8)
    before = env.parse_flag.cache_info().misses
    for _ in range(3):
        assert attnhub.explain(q, q, q).selection.strict
        dispatch.clear_cache()
    assert env.parse_flag.cache_info().misses == before + 1


# -- decoding: bottom-right causal with one query row keeps every key --------------------


@pytest.mark.parametrize("window", [None, (5, 0)])
def test_a_decode_step_is_the_same_call_without_causal(window):
    q = torch.randn(2, 4, 1, 16, dtype=torch.float64)
    k, v = (
        torch.randn(2, 2, 40, 16, dtype=torch.float64),
        torch.randn(2, 2, 40, 16, dtype=torch.float64),
    )
    decision = attnhub.explain(q, k, v, causal=True, alignment="bottom_right", window=window)
    assert not decision.request.causal  # so no backend builds a mask or refuses bottom-right
    out = attnhub.attention(q, k, v, causal=True, alignment="bottom_right", window=window)
    keep = (
        torch.ones(40, dtype=torch.bool) if window is None else torch.arange(40) >= 39 - window[0]
    )
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k[..., keep, :], v[..., keep, :], enable_gqa=True
    )
    torch.testing.assert_close(out, ref)
    # With more than one query row, causal still means causal.
    q2 = torch.randn(2, 4, 2, 16, dtype=torch.float64)
    assert attnhub.explain(q2, k, v, causal=True, alignment="bottom_right").request.causal


def test_a_key_padding_mask_and_a_mask_of_rows_are_different_requests():
    """A bool mask that varies along the keys only (key padding, which triton_flash runs
    as key ranges) and a mask of rows of the same sizes cost a backend differently: they
    are different requests, so a measurement of one never ranks the other."""
    from attnhub import measured

    q, k, v = (torch.randn(2, 4, 12, 16) for _ in range(3))
    keys = torch.ones(2, 1, 1, 12, dtype=torch.bool)
    per_key = [attnhub.explain(q, k, v, m).request for m in (keys, keys[0, 0, 0])]
    rows = [attnhub.explain(q, k, v, m).request
            for m in (torch.ones(2, 1, 12, 12, dtype=torch.bool), torch.ones(2, 4, 1, 12, dtype=torch.bool))]  # fmt: skip
    assert all(r.mask_per_key for r in per_key) and not any(r.mask_per_key for r in rows)
    per_key_keys = {measured.request_key(r) for r in per_key}
    rows_keys = {measured.request_key(r) for r in rows}
    assert len(per_key_keys) == len(rows_keys) == 1 and per_key_keys.isdisjoint(rows_keys)
    assert "bool mask (per key)" in attnhub.explain(q, k, v, keys).signature


def test_a_backend_whose_lse_has_no_gradient_never_serves_a_loss_on_the_lse(fake_registry):
    """An lse without a gradient (PyTorch's fused kernels through their ATen ops) would
    make a loss on it a constant: such a backend serves return_lse without autograd and
    autograd without return_lse, and is declined, with the reason, where both meet."""

    class DetachedLse(_Fake):
        name = "detached_lse"
        priority = 100
        lse = True  # and lse_grad left undeclared

        def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
            out = super().forward(query, key, value, attn_mask, params)
            return (out[0], out[1].detach()) if params.return_lse else out

    fast = DetachedLse()
    fake_registry.add(fast)
    fake_registry.add(fake("differentiable", lse=True, lse_grad=True))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    q, k, v = (t.float().requires_grad_() for t in (q, k, v))
    with torch.no_grad():
        assert attnhub.explain(q, k, v, causal=True, return_lse=True).chosen == "detached_lse"
    assert attnhub.explain(q, k, v, causal=True).chosen == "detached_lse"
    decision = attnhub.explain(q, k, v, causal=True, return_lse=True)
    assert decision.chosen == "differentiable"
    assert decision.reasons()["detached_lse"] == [
        "a gradient through the returned lse is not supported"
    ]
    before = fast.calls
    out, lse = attnhub.attention(q, k, v, causal=True, return_lse=True)
    assert fast.calls == before and lse.requires_grad
    got = torch.autograd.grad(lse.sum() + out.sum(), (q, k, v))
    params = AttentionParams(causal=True, scale=8**-0.5)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    r, rl = reference_attention(q64, k64, v64, None, params)
    expected = torch.autograd.grad(rl.sum() + r.sum(), (q64, k64, v64))
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g.double(), e, atol=1e-5, rtol=1e-4)
    with pytest.raises(attnhub.NoBackendError, match="a gradient through the returned lse"):
        attnhub.attention(q, k, v, causal=True, return_lse=True, backend="detached_lse")


def test_the_call_options_are_named_in_one_place():
    """attention(), explain() and the option plumbing behind them name the options of
    OPTION_NAMES (AttentionParams' fields), in its order, which is also the order of
    the options tuples the hot path passes positionally: an option added to one of
    them and not to the others fails here."""
    from attnhub import validation

    def keyword_only(function: Any) -> tuple[str, ...]:
        parameters = inspect.signature(function).parameters.values()
        return tuple(p.name for p in parameters if p.kind is p.KEYWORD_ONLY)

    assert keyword_only(attnhub.attention) == (*OPTION_NAMES, "backend")
    assert keyword_only(attnhub.explain) == (*OPTION_NAMES, "backend")
    for overload in getattr(typing, "get_overloads", lambda f: [])(api.attention):
        assert keyword_only(overload) == (*OPTION_NAMES, "backend")
    assert tuple(inspect.signature(api._options_key).parameters) == OPTION_NAMES
    assert keyword_only(validation.make_params) == ("key", *OPTION_NAMES)
    values = tuple(range(len(OPTION_NAMES)))
    assert api._options_dict(values) == dict(zip(OPTION_NAMES, values))
    with pytest.raises(ValueError):  # a tuple of another length is a bug, not a call
        api._options_dict(values[:-1])


def test_selection_and_policy_arguments_are_checked_where_they_are_given():
    """set_policy took any object (the next call warned and ranked by priority); a None
    name in use_backend read as the unknown backend ''; patch(aliases=2) was taken.
    Each is a TypeError naming the argument now."""
    with pytest.raises(TypeError, match="policy must be None or a RankingPolicy"):
        attnhub.set_policy("fastest")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"use_backend's names .* got None"), attnhub.use_backend(None):  # type: ignore[arg-type]  # fmt: skip
        pass
    with pytest.raises(TypeError, match="aliases must be a bool"):
        attnhub.patch(aliases=2)  # type: ignore[arg-type]
    assert not attnhub.patching.is_patched()


def test_stats_count_every_call_of_every_thread_while_read():
    """Each decided call counts through its backend's counter (call_stats.counter): no
    count is lost between threads calling at once, reading stats() meanwhile neither
    changes nor breaks them, and a count outlives the cache entries it was made by."""
    q = torch.randn(1, 1, 4, 8)
    attnhub.attention(q, q, q, backend="torch_sdpa")  # decided before the threads start
    attnhub.reset_stats()
    errors: list[BaseException] = []
    start = threading.Barrier(5)

    def work() -> None:
        try:
            start.wait()
            for _ in range(500):
                attnhub.attention(q, q, q, backend="torch_sdpa")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    start.wait()
    seen = [attnhub.stats().get("torch_sdpa", 0) for _ in range(50)]
    for t in threads:
        t.join()
    assert not errors
    assert seen == sorted(seen) and all(0 <= n <= 2000 for n in seen)
    assert attnhub.stats() == {"torch_sdpa": 2000}
    api.clear_call_cache()  # the entries go; the counts stay, and count on
    attnhub.attention(q, q, q, backend="torch_sdpa")
    assert attnhub.stats() == {"torch_sdpa": 2001}
    attnhub.reset_stats()
    assert attnhub.stats() == {}
