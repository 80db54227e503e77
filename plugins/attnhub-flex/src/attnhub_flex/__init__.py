"""``flex_attention``: PyTorch's FlexAttention behind attnhub.

contract.md's features become FlexAttention's two hooks:

- ``mask_mod`` (which keys a query may see; it also builds the ``BlockMask`` that lets
  the kernel skip whole blocks): causal in both alignments, the window, and a bool
  ``attn_mask`` read from the captured tensor;
- ``score_mod`` (how a kept score changes): the softcap, then a float ``attn_mask``
  added from the captured tensor, in contract.md's order (FlexAttention has already
  applied ``scale``).

A block-sparse layout (``block_sparse=``, an ``attnhub.BlockSparseLayout``) becomes a
``BlockMask`` built with ``BlockMask.from_kv_blocks`` from the layout's own compressed
lists (partial and full blocks: ``layout.kv_lists()``, at the layout's ``block_size``),
intersected with the blocks the other masks keep, and a ``mask_mod`` that is exact at
token level (the layout's block state and its token-level ``mask_mod``, and the other
masks). It is built once per (layout, Nq, Nk, causal, alignment, window) and cached; see
:func:`_layout_block_mask`.

Grouped-query attention is ``enable_gqa=True``; the log-sum-exp comes from the kernel
(natural log, -inf on rows with no key). Not offered, and declared so: dropout
(FlexAttention has none, pytorch/pytorch#141784), a gradient for a float mask, and
float64; nor, on CUDA, a float mask with a backward (its rows hidden by a large finite
value lose their weights in the backward: ``FlexAttention.extra_reasons``).

How it runs: on CUDA through ``torch.compile(flex_attention, dynamic=False)``, the
fused Triton kernel (memory linear in N). Each new shape compiles once; the dynamo
cache limits are raised so that a run with many shapes neither falls back to a slower
dynamic-shape kernel nor, after eight shapes, to the eager path (see
shared/perf/anchors-h200.md). On CPU the compiled kernel serves only inference without
the lse ("torch.compile on CPU only supports inference and `return_lse` is not
supported yet"), so the CPU path is FlexAttention's eager implementation, which
materializes the scores (memory quadratic there, declared so per call) and has no
backward ("FlexAttention does not support backward on CPU"), so CPU calls that need
gradients are refused.
"""

from __future__ import annotations

import functools
import threading
import warnings
import weakref
from typing import Any

import torch

from attnhub import AttentionParams, AttentionRequest, Backend, hookimpl
from attnhub.eager import keeps_tensors
from attnhub.mask_values import clamp_beyond_log2_range
from attnhub.registry import BackendRegistry

__all__ = ["FlexAttention", "attnhub_register_backends"]

# Above the number of distinct shapes a benchmark or a model's run sees.
_DYNAMO_CACHE_LIMIT = 256


def _flex_module() -> Any:
    from torch.nn.attention import flex_attention as flex

    return flex


@functools.cache
def _compiled_flex() -> Any:
    import torch._dynamo

    config = torch._dynamo.config
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):  # fmt: skip
        if hasattr(config, name):
            setattr(config, name, max(getattr(config, name), _DYNAMO_CACHE_LIMIT))
    return torch.compile(_flex_module().flex_attention, dynamic=False)


def _as_4d(mask: torch.Tensor) -> torch.Tensor:
    return mask.reshape((1,) * (4 - mask.dim()) + tuple(mask.shape))


def _index(sizes: torch.Size, *indices: Any) -> tuple[Any, ...]:
    """Index a captured (broadcast) mask: dimensions of size 1 are read at 0."""
    return tuple(i if n > 1 else 0 for n, i in zip(sizes, indices, strict=True))


def _mods(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, params: AttentionParams
) -> tuple[Any, Any]:
    """(mask_mod or None, score_mod or None) for the call, without the layout."""
    nq, nk = query.shape[2], key.shape[2]
    offset = nk - nq if params.bottom_right else 0
    conditions = []
    if params.causal:
        conditions.append(lambda b, h, q, k: k <= q + offset)
    if params.window is not None:
        left, right = params.window
        if left is not None:
            conditions.append(lambda b, h, q, k: k >= q + offset - left)
        if right is not None:
            conditions.append(lambda b, h, q, k: k <= q + offset + right)
    bool_mask = float_mask = None
    if attn_mask is not None:
        m = _as_4d(attn_mask)
        # Index broadcast dimensions at 0 so the captured tensor keeps its own size.
        sizes = m.shape
        if m.dtype == torch.bool:
            bool_mask = m
            conditions.append(lambda b, h, q, k: bool_mask[_index(sizes, b, h, q, k)])
        else:
            float_mask = m
    mask_mod = None
    if conditions:

        def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
            keep = conditions[0](b, h, q, k)
            for condition in conditions[1:]:
                keep = keep & condition(b, h, q, k)
            return keep

    score_mod = None
    if params.softcap is not None or float_mask is not None:
        cap = params.softcap
        fm = float_mask
        fsizes = None if fm is None else fm.shape

        def score_mod(score: Any, b: Any, h: Any, q: Any, k: Any) -> Any:
            # At least float32, as the contract computes scores: the compiled kernel
            # hands score_mod float32 scores, but the CPU's eager path those of a
            # half-precision query in its dtype, and a float32 mask cast to it was
            # rounded (-1e5 became -inf in float16, emptying rows that keep keys).
            if score.dtype in (torch.float16, torch.bfloat16):
                score = score.float()
            if cap is not None:
                score = cap * torch.tanh(score / cap)
            if fm is not None:
                assert fsizes is not None
                # Clamped where the kernel's log2 units would overflow (finfo.min rows).
                score = score + clamp_beyond_log2_range(
                    fm[_index(fsizes, b, h, q, k)].to(score.dtype)
                )
            return score

    return mask_mod, score_mod


# -- block-sparse layouts ------------------------------------------------------------
#
# The compiled CUDA kernel tiles each sparse block with BLOCK_M x BLOCK_N tiles and
# raises "Q and KV block size must be divisible by BLOCK_M and BLOCK_N" otherwise; its
# default configurations use tiles of up to 128 (torch/_inductor/template_heuristics/
# triton.py), so a layout is handed over at its own block size only when both sides
# are multiples of 128. Other block sizes are served as exactly, through a BlockMask of
# 128 x 128 blocks coarsened from the layout's (kept: any sub-block kept; full: every
# sub-block full), the token-level mask_mod doing the rest. The eager CPU
# implementation evaluates mask_mod on every score and ignores the block lists, so
# there any block size is taken as it is.
_KERNEL_BLOCK = 128

# layout -> {(Nq, Nk, device, causal offset, window): BlockMask}. Weak keys: the cache
# never keeps a layout alive, and an entry goes when its layout does (the BlockMask's
# mask_mod captures the layout's tensors and mask_mod, never the layout itself, so the
# value does not keep its key alive). Keying by id() instead would need the layout kept
# alive to stop a recycled id from returning another layout's BlockMask.
_block_masks: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Any]] = (
    weakref.WeakKeyDictionary()
)
_block_masks_lock = threading.Lock()
# BlockMask builds, counted for the tests (a reused layout must not rebuild).
block_mask_builds = 0

# Calls whose mask is only causal and window structure (no bool attn_mask, no layout): their
# mask_mod depends on (Nq, Nk, causal, the diagonal's offset, window) alone, so one
# BlockMask per such signature, device, batch and head count serves every such call
# (a model's layers share all of them). B and H are the call's, not broadcast: with a
# (1, 1) BlockMask an fp32 call (B3 H2 Hkv1 Nq104 Nk3 D32 Dv64, bottom-right causal)
# failed to compile on an H100 (Inductor's NoValidChoicesError, 2026-12-05; it passed
# with the call's B and H before the cache, and passes again with them). Built
# per call, create_block_mask ran at every call: a causal forward through the plugin
# read 10-29 TFLOP/s on an H100 where the kernel alone runs 320-460 (2026-12-05,
# benchmarks/results/archive/row-order-*). At most _STRUCTURE_MASKS entries, the
# oldest dropped first.
_STRUCTURE_MASKS = 64
_structure_masks: dict[tuple[Any, ...], Any] = {}
# Both caches serve calls in plain eager mode outside CUDA-graph capture only
# (attnhub.eager.keeps_tensors): traced, a mask is built in the graph (no cache or lock
# is traced); under FakeTensorMode it is fake, and a real one kept before would reach
# the fake call (both raised "Please convert all Tensors to FakeTensors"); while a CUDA
# graph is captured, the kernels that fill it are recorded, not run.


def _compress(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(num, indices) int32 lists of the kept columns per row, kept ones first."""
    num = mask.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return num.contiguous(), indices.contiguous()


def _reduce_to_blocks(
    mod: Any, bh: tuple[int, int], nq: int, nk: int, block: tuple[int, int], device: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept, full) bool blocks of a token-level mask_mod; full = every in-range pair
    kept (the kernel bounds-checks the ragged edge). One query block at a time, so
    O(bq * Nk) memory."""
    bq, bk = block
    nqb, nkb = -(-nq // bq), -(-nk // bk)
    nb, nh = bh
    kept = torch.zeros(nb, nh, nqb, nkb, dtype=torch.bool, device=device)
    full = torch.zeros_like(kept)
    b = torch.arange(nb, device=device).view(-1, 1, 1, 1)
    h = torch.arange(nh, device=device).view(1, -1, 1, 1)
    kv = torch.arange(nkb * bk, device=device).view(1, 1, 1, -1)
    kv_valid = kv < nk
    kv_clamped = kv.clamp(max=nk - 1)
    for row in range(nqb):
        q = torch.arange(row * bq, (row + 1) * bq, device=device).view(1, 1, -1, 1)
        valid = (q < nq) & kv_valid
        tile = mod(b, h, q.clamp(max=nq - 1), kv_clamped).expand(nb, nh, bq, nkb * bk)
        tile = (tile & valid).view(nb, nh, bq, nkb, bk)
        invalid = (~valid).expand(1, 1, bq, nkb * bk).reshape(1, 1, bq, nkb, bk)
        kept[:, :, row] = tile.any(dim=(2, 4))
        full[:, :, row] = (tile | invalid).all(dim=(2, 4)) & kept[:, :, row]
    return kept, full


def _coarsen(
    kept: torch.Tensor, full: torch.Tensor, block: tuple[int, int], target: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of ``target`` tokens from blocks of ``block`` tokens (target a multiple):
    kept if any sub-block is kept, full if every sub-block is (blocks past the end
    count as full, they lie beyond N and the kernel bounds-checks them)."""
    fq, fk = target[0] // block[0], target[1] // block[1]
    b, h, nqb, nkb = kept.shape
    pq, pk = -nqb % fq, -nkb % fk
    kept = torch.nn.functional.pad(kept, (0, pk, 0, pq), value=False)
    full = torch.nn.functional.pad(full, (0, pk, 0, pq), value=True)
    shape = (b, h, (nqb + pq) // fq, fq, (nkb + pk) // fk, fk)
    kept_c = kept.view(shape).any(dim=5).any(dim=3)
    full_c = full.view(shape).all(dim=5).all(dim=3) & kept_c
    return kept_c, full_c


def _sparse_block(layout: Any, device_type: str) -> tuple[int, int]:
    """The BlockMask's block size for this layout on this device (see _KERNEL_BLOCK)."""
    if device_type == "cpu":
        return layout.block_size
    return tuple(  # type: ignore[return-value]
        b if b % _KERNEL_BLOCK == 0 else _KERNEL_BLOCK if _KERNEL_BLOCK % b == 0 else -1
        for b in layout.block_size
    )


def _build_layout_block_mask(
    layout: Any,
    nq: int,
    nk: int,
    other_mod: Any,
    other_bh: tuple[int, int],
    device: Any,
    sparse_block: tuple[int, int],
) -> Any:
    """A BlockMask meaning ``layout.to_dense_mask(nq, nk) & other_mod``."""
    global block_mask_builds
    flex = _flex_module()
    layout_mod = layout.token_mask_mod()
    if other_mod is None:
        mask_mod = layout_mod
    else:

        def mask_mod(b: Any, h: Any, q: Any, k: Any) -> Any:
            return layout_mod(b, h, q, k) & other_mod(b, h, q, k)

    block = layout.block_size
    if other_mod is None and sparse_block == block:
        # The layout's own lists, as they are.
        partial_index, full_index = layout.kv_lists()
        partial = (partial_index.num, partial_index.indices)
        full_lists = (full_index.num, full_index.indices)
    else:
        kept = layout.block_mask
        full = layout.full_blocks
        if other_mod is not None:
            o_kept, o_full = _reduce_to_blocks(other_mod, other_bh, nq, nk, block, device)
            kept, full = kept & o_kept, full & o_full
        if sparse_block != block:
            kept, full = _coarsen(kept, full, block, sparse_block)
        partial = _compress(kept & ~full)
        full_lists = _compress(full)
    block_mask_builds += 1
    return flex.BlockMask.from_kv_blocks(
        partial[0],
        partial[1],
        full_lists[0],
        full_lists[1],
        BLOCK_SIZE=sparse_block,
        mask_mod=mask_mod,
        seq_lengths=(nq, nk),
    )


def _layout_block_mask(
    query: torch.Tensor, key: torch.Tensor, attn_mask: torch.Tensor | None, params: AttentionParams
) -> Any:
    """The call's BlockMask for ``params.block_sparse``, cached unless a bool
    ``attn_mask`` (whose values the cache cannot key on) takes part."""
    layout = params.block_sparse
    nq, nk = query.shape[2], key.shape[2]
    # Only the mask_mod side of _mods matters here: the float mask and the softcap
    # are score_mod, which the BlockMask does not hold.
    other_mod, _ = _mods(query, key, attn_mask if _is_bool(attn_mask) else None, params)
    other_bh = (1, 1)
    if _is_bool(attn_mask):
        m = _as_4d(attn_mask)  # type: ignore[arg-type]
        other_bh = (m.shape[0], m.shape[1])
    sparse_block = _sparse_block(layout, query.device.type)
    if min(sparse_block) < 1:
        # A side neither a multiple nor a divisor of 128: reduce the exact token-level
        # mask to 128 x 128 blocks (quadratic in N to build, like create_block_mask).
        sparse_block = (_KERNEL_BLOCK, _KERNEL_BLOCK)
        lmod = layout.token_mask_mod()
        mod = (
            lmod
            if other_mod is None
            else (lambda b, h, q, k: lmod(b, h, q, k) & other_mod(b, h, q, k))
        )
        b = max(layout.shape[0], other_bh[0])
        h = max(layout.shape[1], other_bh[1])
        return _flex_module().create_block_mask(
            mod, b, h, nq, nk, device=query.device, BLOCK_SIZE=sparse_block
        )
    if _is_bool(attn_mask):
        return _build_layout_block_mask(
            layout, nq, nk, other_mod, other_bh, query.device, sparse_block
        )
    if not keeps_tensors(query, key):
        return _build_layout_block_mask(
            layout, nq, nk, other_mod, other_bh, query.device, sparse_block
        )
    signature = _structure_signature(query, key, params)
    with _block_masks_lock:
        per_layout = _block_masks.setdefault(layout, {})
        hit = per_layout.get(signature)
    if hit is None:
        hit = _build_layout_block_mask(
            layout, nq, nk, other_mod, other_bh, query.device, sparse_block
        )
        with _block_masks_lock:
            per_layout[signature] = hit
    return hit


def _structure_signature(
    query: torch.Tensor, key: torch.Tensor, params: AttentionParams
) -> tuple[Any, ...]:
    """What a call's causal and window mask_mod depends on: (Nq, Nk, device, causal, the
    diagonal's offset, window); the key of both BlockMask caches."""
    nq, nk = query.shape[2], key.shape[2]
    offset = nk - nq if params.bottom_right else 0
    return (nq, nk, str(query.device), params.causal, offset, params.window)


def _structure_block_mask(
    mask_mod: Any, query: torch.Tensor, key: torch.Tensor, params: AttentionParams
) -> Any:
    """The BlockMask of a call masked by causal and window structure alone (``mask_mod``
    from :func:`_mods` with no bool attn_mask), built once per signature, batch and
    query head count (see ``_structure_masks``)."""
    global block_mask_builds
    b, hq, nq = query.shape[:3]
    nk = key.shape[2]
    if not keeps_tensors(query, key):
        return _flex_module().create_block_mask(mask_mod, b, hq, nq, nk, device=query.device)
    signature = (*_structure_signature(query, key, params), b, hq)
    with _block_masks_lock:
        hit = _structure_masks.get(signature)
    if hit is None:
        hit = _flex_module().create_block_mask(mask_mod, b, hq, nq, nk, device=query.device)
        with _block_masks_lock:
            block_mask_builds += 1
            if len(_structure_masks) >= _STRUCTURE_MASKS:
                del _structure_masks[next(iter(_structure_masks))]
            _structure_masks[signature] = hit
    return hit


def _is_bool(attn_mask: torch.Tensor | None) -> bool:
    return attn_mask is not None and attn_mask.dtype == torch.bool


class FlexAttention(Backend):
    name = "flex_attention"
    description = "torch.nn.attention.flex_attention (compiled on CUDA, eager on CPU)"
    priority = 15
    devices = frozenset({"cpu", "cuda"})
    min_capability = (8, 0)
    dtypes = frozenset({torch.float16, torch.bfloat16, torch.float32})
    head_dims = (16, 256)  # the kernel: "embedding dimension ... at least 16"
    value_head_dim = True
    mask_kinds = frozenset({"none", "bool", "float"})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    window = softcap = gqa = lse = block_sparse = True
    backward = lse_grad = True  # flex_attention's backward takes the lse's gradient
    memory = "linear"
    compile_safe = True
    # On CUDA each new shape compiles (dynamic=False, see the module docstring): autotune
    # leaves it untimed rather than compile in a user's first call of each signature.
    compiles_per_shape = True
    copies_strided = False
    # attnhub.attention_varlen and attention_kvcache as document and paged masks (serving.py).
    layouts = frozenset({"dense", "varlen", "kvcache", "paged"})

    def unavailable_reason(self) -> str | None:
        try:
            _flex_module()
        except Exception as exc:
            return f"torch.nn.attention.flex_attention does not import: {type(exc).__name__}: {exc}"
        return None

    def extra_reasons(self, request: AttentionRequest) -> list[str]:
        if request.device_type == "cpu" and request.traced:
            # Traced, flex_attention is lowered by Inductor, whose CPU kernel is
            # forward-only without the lse ("torch.compile on CPU only supports
            # inference and `return_lse` is not supported yet", torch 2.13) and failed
            # to compile for a bottom-right causal window with a negative scale (a C++
            # compile error, dev CPU, 2026-12-05). Eager CPU calls run its math path.
            return ["traced on CPU: Inductor's FlexAttention kernel there is limited"]
        if request.device_type == "cpu" and request.needs_grad:
            # FlexAttention's own words: "FlexAttention does not support backward on CPU".
            return ["FlexAttention has no backward on CPU"]
        if request.device_type == "cuda" and request.needs_grad and request.mask == "float":
            # The backward recomputes the weights from one float32 lse per row, which
            # loses log(Nk) beside a large hiding value (-1e9, finfo.min): on an H100
            # (benchmarks/float_mask_probe.py, bf16) padding rows hidden by -1e9 gave
            # FlexAttention's compiled kernel dQ 1e8 from the reference. Dispatch does
            # not read the mask's values, so every such call goes elsewhere (also the
            # float32 mask with a half-precision query, for which Inductor found no
            # backward configuration in shared memory on the H200).
            return [
                "a float mask with a backward on CUDA: the backward recomputes weights "
                "from one float32 lse per row, which rows hidden by a large finite value "
                "(-1e9, finfo.min) lose"
            ]
        if request.device_type == "cuda" and request.head_dim & (request.head_dim - 1):
            # The compiled kernel pads D to a power of two in recent releases only.
            return [f"head_dim={request.head_dim} is not a power of two (compiled kernel)"]
        return []

    def memory_class(self, request: AttentionRequest) -> str:
        return "quadratic" if request.device_type == "cpu" else "linear"

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        flex = _flex_module()
        b, hq, nq, _ = query.shape
        nk = key.shape[2]
        mask_mod, score_mod = _mods(query, key, attn_mask, params)
        block_mask = None
        if params.block_sparse is not None:
            block_mask = _layout_block_mask(query, key, attn_mask, params)
        elif mask_mod is not None and not _is_bool(attn_mask):  # a float mask is score_mod's
            block_mask = _structure_block_mask(mask_mod, query, key, params)
        elif mask_mod is not None:
            block_mask = flex.create_block_mask(mask_mod, b, hq, nq, nk, device=query.device)
        kwargs: dict[str, Any] = {
            "score_mod": score_mod,
            "block_mask": block_mask,
            "scale": params.scale,
            "enable_gqa": hq != key.shape[1],
        }
        if params.return_lse:
            kwargs["return_aux"] = flex.AuxRequest(lse=True)
        if query.device.type == "cuda":
            result = _compiled_flex()(query, key, value, **kwargs)
        else:
            with warnings.catch_warnings():
                # "flex_attention called without torch.compile()": on purpose, see above.
                warnings.simplefilter("ignore", UserWarning)
                result = flex.flex_attention(query, key, value, **kwargs)
        if params.return_lse:
            out, aux = result
            return out, aux.lse.float()
        return result

    def forward_varlen(  # type: ignore[no-untyped-def]
        self, query, key, value, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, params
    ):
        from . import serving

        flex = _flex_module()
        run = _runner(query.device)
        return serving.varlen(run, flex, query, key, value, cu_seqlens_q, cu_seqlens_k, params)

    def forward_kvcache(  # type: ignore[no-untyped-def]
        self, query, k_cache, v_cache, seqlens_k, block_table, params
    ):
        from . import serving

        flex = _flex_module()
        run = _runner(query.device)
        return serving.kvcache(run, flex, query, k_cache, v_cache, seqlens_k, block_table, params)


def _runner(device: torch.device) -> Any:
    """flex_attention as :meth:`FlexAttention.forward` runs it: compiled on CUDA, eager
    (its warning silenced) elsewhere."""
    if device.type == "cuda":
        return _compiled_flex()
    flex = _flex_module()

    def run(*args: Any, **kwargs: Any) -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return flex.flex_attention(*args, **kwargs)

    return run


@hookimpl
def attnhub_register_backends(registry: BackendRegistry) -> None:
    registry.add(FlexAttention())
