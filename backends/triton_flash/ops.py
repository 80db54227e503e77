"""``attnhub::triton_flash_fwd`` / ``attnhub::triton_flash_bwd``: the kernels as torch ops.

Registered with :func:`torch.library.triton_op` and launched through
:func:`torch.library.wrap_triton`, so ``torch.compile`` sees the Triton kernels instead
of breaking the graph; the fake (meta) implementation is the same Python run on fake
tensors (``triton_op`` does not launch kernels then). The backward is attached with
``register_autograd``.

Plain eager calls skip the op's dispatch: :func:`direct` runs the same implementations
through a small ``autograd.Function`` (the torch.library path costs 130-240 us of
Python per forward on the dev CPU against 25-30 us for the implementation itself,
which is most of the time of a small or very sparse call); anything being traced,
compiled or intercepted (FakeTensor, FunctionalTensor, dispatch or function modes,
functorch transforms) still goes through the op. A plain call that records no
gradient skips the autograd.Function too, and computes no lse unless asked
(``flash_attention(..., return_lse=False)``).

Eager launches on CUDA reuse a plan per call signature (``_PLANS``: the compiled
kernel, grid and arguments, launched without Triton's per-call binder; issue 17,
item 3), so a repeated small call costs its output allocations and one launch each.

Importing this module imports Triton and compiles nothing; kernels compile on first
launch. Set ``TRITON_INTERPRET=1`` before importing it to run the kernels on CPU
tensors in Triton's interpreter.
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
from torch.autograd import forward_ad
from torch.library import triton_op, wrap_triton
from triton.runtime import _allocation

from attnhub.eager import plain_eager
from attnhub.request import device_capability

from . import kernels, kernels_tma, tuning

try:  # Gluon's Hopper API (warpgroup MMA, mbarriers, warp_specialize): Triton 3.6 has it
    from . import kernels_gluon, kernels_gluon_bwd
except ImportError:  # an older Triton: the D=128 forward keeps the TMA and pointer kernels
    kernels_gluon = kernels_gluon_bwd = None  # type: ignore[assignment]
from .common import interpreting
from .configs import LaunchConfig, backward_configs, backward_launch, launch_config, merged_meta
from .launch import CachedLaunch

# Window sides and the causal clamp are passed as ints; this stands for "no window".
NO_WINDOW = -1


def _noop_launch(*args, **kwargs) -> None:
    return None


class _NoLaunch:
    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        return _noop_launch


def _launcher(kernel, like: torch.Tensor):  # type: ignore[no-untyped-def]
    """``kernel[grid]`` as torch.compile should see it.

    On the GPU, wrap_triton makes the launch traceable (and a no-op on fake tensors).
    Interpreted kernels cannot be traced: wrap_triton returns them unchanged (PyTorch
    2.13; older versions reject them), and they would run numpy on fake tensors. So
    under the interpreter we launch directly and skip the launch while tracing with
    fake tensors (the op's outputs are then only allocated, which is all a fake
    implementation needs).
    """
    if interpreting():
        from torch._subclasses.fake_tensor import is_fake

        return _NoLaunch() if is_fake(like) else _Serialized(kernel)
    return wrap_triton(kernel)


# Plans are recorded and used only while _launcher is this function (a tool that
# replaces it, to record launches, sees every launch).
_default_launcher = _launcher


# Triton's interpreter patches triton.language globals while a kernel runs, so two
# threads interpreting at once break each other ("Did you forget to add @triton.jit?",
# seen with triton 3.6). Interpreted launches take turns; GPU launches are unaffected.
_INTERPRETER_LOCK = threading.Lock()


class _Serialized:
    def __init__(self, kernel) -> None:  # type: ignore[no-untyped-def]
        self.kernel = kernel

    def __getitem__(self, grid):  # type: ignore[no-untyped-def]
        launch = self.kernel[grid]

        def locked(*args, **kwargs):  # type: ignore[no-untyped-def]
            with _INTERPRETER_LOCK:
                return launch(*args, **kwargs)

        return locked


def _capability(device: torch.device) -> tuple[int, int] | None:
    # A name of this module's own: tests that fake a device replace it here.
    return device_capability(device)


# Grid and tile arithmetic on host ints. triton.cdiv and triton.next_power_of_2 compute
# the same through Triton's constexpr-function wrapper, ~2 us a call on the dev CPU
# against 0.03-0.04 here; a forward+backward made eight such calls.
def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints, b > 0."""
    return -(-a // b)


def _next_power_of_2(n: int) -> int:
    """The least power of two >= n, for n >= 1."""
    return 1 << (n - 1).bit_length()


def _input_precision(dtype: torch.dtype) -> str:
    # float32 inputs follow PyTorch's global setting: "highest" means IEEE products.
    # For float16/bfloat16 the setting is moot (tensor cores multiply them exactly);
    # "tf32" is Triton's default there.
    if dtype == torch.float32 and torch.get_float32_matmul_precision() == "highest":
        return "ieee"
    return "tf32"


def _mask_view(mask: torch.Tensor | None, q: torch.Tensor) -> tuple[torch.Tensor, tuple, int]:
    """(tensor to pass, its four strides with 0 for broadcast dims, MASK_KIND)."""
    if mask is None:
        return q, (0, 0, 0, 0), 0
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    strides = tuple(0 if size == 1 else stride for size, stride in zip(mask.shape, mask.stride()))
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), strides, 1
    return mask, strides, 2


# A call with a float mask (MASK_KIND 2) keeps, for its backward, two float32 numbers a
# query row in place of the lse: the row's max m of the scores (natural units, as the
# kernels take a float mask's scores: common._scores) and log2 of its sum l, packed in
# one int64 (m's bits low, log2(l)'s high; the kernels' _fwd_finish and _load_lse2).
# Such a mask can put a row's max far from 0 (a row that -1e9 or finfo.min hides: m
# about -1e9, or -3.4e38), where the float32 lse m + ln(l) keeps few or none of ln(l)'s
# bits: weights recomputed from it came out up to l times too large (gradients 17 where
# the reference has 0.13, fp32, a row hidden by -1e9 over 64 keys). The public lse is
# derived from the stats.
_LN2 = math.log(2.0)


def _keeps_row_stats(mask: torch.Tensor | None) -> bool:
    """Whether a call with this mask keeps row stats instead of an lse (a float mask)."""
    return mask is not None and mask.dtype != torch.bool


def _row_stats_halves(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(m, log2 l): float32 views of packed row stats' two halves (int64, any shape)."""
    pair = stats.view(torch.float32).unflatten(-1, (-1, 2))
    return pair[..., 0], pair[..., 1]


def lse_of_row_stats(stats: torch.Tensor) -> torch.Tensor:
    """The float32 natural-log lse, m + log2(l) * ln 2, of packed row stats (int64,
    any shape): the value the kernels store as the lse of a call without a float mask
    (-inf for a row with no kept key, whose stats are m = -inf, log2 l = 0)."""
    m, log2l = _row_stats_halves(stats)
    return m + log2l * _LN2


def _with_lse(
    out: torch.Tensor, rows: torch.Tensor | None, row_stats: bool, public_lse: bool = True
):  # type: ignore[no-untyped-def]
    """(out, lse, stats) of a forward whose kernel wrote ``rows``: the lse itself (stats
    None), or packed row stats (``row_stats``) and the lse derived from them (None
    without ``public_lse``: a call that returns none derives none, two elementwise
    launches)."""
    if row_stats and rows is not None:
        return out, lse_of_row_stats(rows) if public_lse else None, rows
    return out, rows, None


def op_outputs(out: torch.Tensor, lse: torch.Tensor, stats: torch.Tensor | None):  # type: ignore[no-untyped-def]
    """A forward op's (out, lse, stats): stats None becomes an empty int64 tensor (an
    op's outputs are tensors, and may not alias each other). :func:`saved_rows` reads
    it back."""
    if stats is None:
        stats = torch.empty((0,), dtype=torch.int64, device=out.device)
    return out, lse, stats


def saved_rows(lse: torch.Tensor, stats: torch.Tensor) -> torch.Tensor:
    """What a forward op's backward reads per query row, from its outputs
    (:func:`op_outputs`): the row stats where there are some, else the lse."""
    return stats if stats.numel() else lse


_TILE_SLACK = 1024  # at least twice any BLOCK_M or BLOCK_N (configs.py: at most 128)


def _band(
    nq: int, nk: int, causal: bool, bottom_right: bool, window_left: int, window_right: int
) -> tuple[bool, int, int, int]:
    """(HAS_BAND, offset, win_left, win_right) with absent sides as "unbounded".

    "Unbounded" must leave a band edge outside every tile, padded rows and keys of the
    last, ragged tiles included (up to _TILE_SLACK / 2 past the lengths): the kernels
    skip a segment outright when its edge is absent (_edge_segments), so an absent side
    may not clip even a padded row's keys."""
    unbounded = nq + nk + 1 + _TILE_SLACK
    left = unbounded if window_left == NO_WINDOW else window_left
    right = unbounded if window_right == NO_WINDOW else window_right
    if causal:
        right = min(right, 0)
    has_band = causal or window_left != NO_WINDOW or window_right != NO_WINDOW
    offset = nk - nq if bottom_right else 0
    return has_band, offset, left, right


def _common_meta(
    q, v, causal, bottom_right, window_left, window_right, softcap, mask_kind, dropout_p
):  # type: ignore[no-untyped-def]
    d, dv = q.shape[-1], v.shape[-1]
    block_d = _next_power_of_2(max(d, 16))
    block_dv = _next_power_of_2(max(dv, 16))
    return {
        "BLOCK_D": block_d,
        "BLOCK_DV": block_dv,
        "EVEN_D": d == block_d and dv == block_dv,
        "HAS_BAND": bool(causal or window_left != NO_WINDOW or window_right != NO_WINDOW),
        "HAS_SOFTCAP": softcap > 0.0,
        "MASK_KIND": mask_kind,
        "HAS_DROPOUT": dropout_p > 0.0,
        "INPUT_PRECISION": _input_precision(q.dtype),
    }


@dataclass(frozen=True)
class _Setup:
    """What every kernel of one call (forward or backward, dense or block-sparse) takes
    beside its tensors, derived once per launch group."""

    mask: torch.Tensor  # the Mask argument (q where there is none)
    mask_strides: tuple  # its four strides, 0 for broadcast dims
    meta: dict[str, Any]  # the shared constexprs (_common_meta)
    # offset, win_left, win_right, qk_scale, sm_scale, softcap, dropout_p: the kernels'
    # trailing scalar arguments, in their order.
    scalars: tuple
    # The forward kernels' FOLD_SCALE: the scale may move into the exponent (kernels'
    # _fwd_step). Needs qk_scale > 0 as a float32 normal number (a max over raw
    # products times a zero or negative scale would be wrong, and -inf * 0 is NaN),
    # and scores that are plain scaled products (no softcap, no float mask).
    fold_scale: bool
    # What launch_config takes as the sequence length (configs.SHORT_N): the most keys
    # one row visits, the band's width where both its sides are bounded, else the longer
    # length. The tiles that suit a program depend on how many it walks, and a 256-key
    # sliding window walks as few as a 256-token sequence.
    walk: int


_FP32_TINY = 1.1754943508222875e-38  # smallest normal float32


@dataclass(frozen=True)
class Packed:
    """Packed sequences (attnhub.attention_varlen; kernels' glossary, "Packed sequences"):
    the (B + 1,) cumulative lengths on the tensors' device and the longest sequence's
    lengths, which size the grids. The launches take each packed (T, heads, D) tensor
    as :meth:`view` gives it, the lse and delta as (heads, Tq)."""

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int

    @property
    def batch(self) -> int:
        return self.cu_q.shape[0] - 1

    def view(self, t: torch.Tensor) -> torch.Tensor:
        """(T, heads, D) as the kernels' (B, heads, T, D) with batch stride 0 (no copy):
        the kernels move each program to its sequence's rows themselves."""
        return t.transpose(0, 1).unsqueeze(0).expand(self.batch, -1, -1, -1)

    def outputs(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_lse: bool):  # type: ignore[no-untyped-def]
        """(out (Tq, Hq, Dv), lse (Hq, Tq) float32 or None, empty) for the views q, k, v:
        the forward's outputs, already final (``empty``) where there is nothing to
        launch: no query rows, or no keys in any sequence (zeros, lse -inf)."""
        hq, tq = q.shape[1], q.shape[2]
        out = torch.empty((tq, hq, v.shape[-1]), device=q.device, dtype=q.dtype)
        lse = torch.empty((hq, tq), device=q.device, dtype=torch.float32) if store_lse else None
        if self.batch * hq * self.max_q == 0 or k.shape[2] == 0:
            out.zero_()
            if lse is not None:
                lse.fill_(float("-inf"))
            return out, lse, True
        return out, lse, False


def _cu(
    packed: Packed | None, like: torch.Tensor, key_ranges: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' CuQ, CuK arguments (``like`` where a kernel never reads one)."""
    if packed is not None:
        return packed.cu_q, packed.cu_k
    return like, (like if key_ranges is None else key_ranges)


def _varlen(packed: Packed | None, key_ranges: torch.Tensor | None) -> int:
    """The kernels' VARLEN: 0 dense, 1 packed sequences, 2 key ranges (glossary)."""
    return 1 if packed is not None else 0 if key_ranges is None else 2


def _setup(
    q,
    v,
    mask,
    nk,
    causal,
    bottom_right,
    window_left,
    window_right,
    softcap,
    scale,
    dropout_p,
    packed=None,
) -> _Setup:  # type: ignore[no-untyped-def]
    mask_t, strides, mask_kind = _mask_view(mask, q)
    nq = q.shape[2]
    if packed is not None:  # the longest sequence's lengths bound the band (Packed)
        nq, nk = packed.max_q, packed.max_k
    _, offset, left, right = _band(nq, nk, causal, bottom_right, window_left, window_right)
    if packed is not None:
        offset = int(bottom_right)  # placed per sequence in the kernels (glossary)
    meta = _common_meta(
        q, v, causal, bottom_right, window_left, window_right, softcap, mask_kind, dropout_p
    )
    qk_scale = scale * math.log2(math.e)
    scalars = (offset, left, right, qk_scale, scale,
               softcap if softcap > 0.0 else 1.0, dropout_p)  # fmt: skip
    fold = _FP32_TINY <= qk_scale < math.inf and softcap <= 0.0 and mask_kind != 2
    walk = max(1, min(max(nq, nk), left + right + 1))  # absent sides: > nq + nk
    return _Setup(mask_t, strides, meta, scalars, fold, walk)


def _edge_segments(
    walks_keys: bool,
    nq: int,
    nk: int,
    cfg: LaunchConfig,
    causal: bool,
    left: int,
    right: int,
    prefix: str = "",
    ragged: bool = False,
) -> dict[str, bool]:
    """MASK_HEAD / MASK_TAIL of a dense kernel: whether its first / last masked segment
    can be non-empty (kernels' glossary, "segments"). A kernel walks keys (forward, dQ:
    the head is the band's left edge, the tail its right edge and a ragged last key tile)
    or queries (dK/dV: the head is the band's right edge, the tail its left edge and
    ragged last tiles of either length). ``prefix`` names a role of the merged backward
    kernel ("KV_", "Q_"), whose ``cfg`` is that role's tiles. ``ragged``: packed
    sequences or key ranges, whose lengths the host does not know: every tail is
    compiled."""
    left_edge = left != NO_WINDOW
    right_edge = causal or right != NO_WINDOW
    if walks_keys:
        head, tail = left_edge, right_edge or nk % cfg.block_n != 0
    else:
        head = right_edge
        tail = left_edge or nq % cfg.block_m != 0 or nk % cfg.block_n != 0
    return {prefix + "MASK_HEAD": head, prefix + "MASK_TAIL": tail or ragged}


# Whether kernels get the row stride of a tensor they stream (K/V in the forward and dQ
# kernels, Q/dO in dK/dV) as a compile-time constant where its rows are packed (row
# stride == head dim, as in a contiguous (B, H, N, D) tensor). A runtime stride gives
# each thread one 64-bit address per row it loads, kept live across the loop; a constant
# one folds them into one base plus immediate offsets: ptxas, sm_90, bf16 D=128 forward
# (128, 64, 8, 3): 172 -> 156 registers; the D=128 N=4096 causal merged backward's spills
# in its loops, 7 stores / 9 loads a step -> none. On the H200 (A B B A,
# benchmarks/results/archive/triton_flash-strides-ab-2026-11-30.json, runtime / constant
# time) the forward ran
# 1.4-11.5% faster at 11 of the 12 grid points (D=64 N=4K non-causal -0.5%), the
# backward 1.6-15.5% faster at 10 (D=64 non-causal N=4K +0.1%, N=16K -1.8%), with
# bitwise the same outputs and gradients. The constant is the tensor's actual stride,
# so the addresses are the same either way; packing only decides where to specialize:
# other layouts ((B, N, H, D) views) keep the runtime stride, so each head dim adds at
# most one more compiled variant. triton_blocksparse's launches take the same constants.
# ``tuning.override(packed_row_strides=False)`` passes every stride at run time (the
# A/B's "runtime" side).
_ROW_STRIDE_ARGS = {"Q": "STRIDE_QM", "DO": "STRIDE_DOM", "K": "STRIDE_KN", "V": "STRIDE_VN"}


def _row_strides(**streamed: torch.Tensor) -> dict[str, int]:
    """The kernels' STRIDE_* constexprs for the tensors they stream, by argument name
    (Q, DO, K, V): the row stride where rows are packed, else 0 (use the runtime
    stride)."""
    tuned = tuning.current()
    packed_ok = tuned is None or tuned.packed_row_strides
    return {
        _ROW_STRIDE_ARGS[name]: t.stride(2) if packed_ok and t.stride(2) == t.shape[-1] else 0
        for name, t in streamed.items()
    }


def _heavy_first(causal: bool, block_d: int) -> bool:
    """The forward and dQ kernels' HEAVY_FIRST (common._row_block): their row blocks run
    last first under a causal band (either alignment, with or without a window), where
    the last rows walk the most keys, at head dims up to 128 (``block_d``: the padded
    one); ``tuning.override(heavy_first=...)`` forces it. Elsewhere every row block
    walks alike and the order changes nothing.

    Measured (benchmarks/row_order_probe.py; results/row-order-h200.md, bf16, causal,
    grid shapes, one process, outputs bitwise equal): forward 1.04-1.06x at N = 4096 and
    16384, D = 128 (H100 runs: D = 64 and fp16 1.02-1.11x), 1.00-1.01x at N = 1024;
    backward 1.00-1.02x. At D = 256 the forward read 0.98x on the H200 and 0.97x on an
    H100, so its rows keep the grid order."""
    tuned = tuning.current()
    if tuned is not None and tuned.heavy_first is not None:
        return tuned.heavy_first
    return causal and block_d <= 128


def _forward_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, store_lse: bool = True,
    row_stats: bool = False,
) -> tuple[torch.Tensor, Any, bool]:  # fmt: skip
    """(out, rows, empty): the forward's outputs, already final (``empty``) where there
    is nothing to launch: no rows, or no keys (zeros and an lse of -inf). ``rows`` is
    the lse (B, Hq, Nq) float32, or with ``row_stats`` the packed row stats (B, Hq, Nq)
    int64 (see _keeps_row_stats); without ``store_lse``, None (nothing allocated)."""
    b, hq, nq, _ = q.shape
    out = torch.empty((b, hq, nq, v.shape[-1]), device=q.device, dtype=q.dtype)
    rows = None
    if store_lse:
        rows = torch.empty((b, hq, nq), device=q.device,
                           dtype=torch.int64 if row_stats else torch.float32)  # fmt: skip
    if b * hq * nq == 0:
        return out, rows, True
    if k.shape[2] == 0:
        out.zero_()
        if rows is not None and row_stats:
            m, log2l = _row_stats_halves(rows)
            m.fill_(float("-inf"))
            log2l.fill_(0.0)  # l = 1, as the kernels store it
        elif rows is not None:
            rows.fill_(float("-inf"))
        return out, rows, True
    return out, rows, False


def _grad_outputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(dq, dk, dv, empty): the gradients, already final (zeros) for empty calls."""
    dq = torch.empty(q.shape, device=q.device, dtype=q.dtype)
    dk = torch.empty(k.shape, device=k.device, dtype=k.dtype)
    dv = torch.empty(v.shape, device=v.device, dtype=v.dtype)
    b, hq, nq, _ = q.shape
    if b * hq * nq == 0 or k.shape[2] == 0:
        return dq.zero_(), dk.zero_(), dv.zero_(), True
    return dq, dk, dv, False


def _launch(
    kernel: Any, like: torch.Tensor, grid: tuple[int, ...], args: tuple, meta: dict[str, Any],
    tensors: int, record: list | None,
) -> None:  # fmt: skip
    """``_launcher(kernel, like)[grid](*args, **meta)``; with ``record`` (a call being
    planned, see _PLANS), appends the launch as a CachedLaunch whose first ``tensors``
    arguments are per-call tensors, or None where no compiled kernel came back."""
    compiled = _launcher(kernel, like)[grid](*args, **meta)
    if record is not None:
        cached = None
        if _is_compiled(compiled):
            cached = CachedLaunch(kernel, compiled, grid, args, meta, tensors)
        record.append(cached)


def _launch_kernel_of_row(
    pointer: Any, gluon: Any, cfg: LaunchConfig, gluon_ok: bool, like: torch.Tensor,
    grid: tuple[int, ...], args: tuple, meta: dict[str, Any], tensors: int, record: list | None,
) -> None:  # fmt: skip
    """:func:`_launch` of one launch's kernel: ``gluon`` (a Gluon kernel, or None where
    this Triton has none) where its row asks for it (``cfg.gluon``) and the call allows
    it (``gluon_ok``), with ``cfg.num_stages`` buffers and its tensor descriptors in
    global scratch that the launch allocates (a plan's CachedLaunch allocates its own);
    else ``pointer`` on the same tiles."""
    if cfg.gluon and gluon_ok and gluon is not None:
        with _scratch_allocator():
            _launch(gluon, like, grid, args, {**meta, "STAGES": cfg.num_stages}, tensors, record)
    else:
        _launch(pointer, like, grid, args, meta, tensors, record)


def _delta(
    out: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    meta: dict[str, Any],
    record: list | None = None,
    packed: Packed | None = None,
) -> torch.Tensor:
    """rowsum(dO * O) (B, Hq, Nq) float32 from the preprocess kernel, minus ``dlse``:
    d lse / d s = P, so a gradient on lse enters as dS = P * (dP - (delta - dlse)).
    ``meta``: the call's shared constexprs; the kernel takes BLOCK_DV and the
    INPUT_PRECISION of the backward's dP, whose sums it repeats. ``record``: see
    :func:`_launch` (4 tensors: out, dout, delta, CuQ). ``packed``: out and dout are
    :meth:`Packed.view` views, delta and dlse (Hq, Tq)."""
    b, hq, nq, dv = out.shape
    shape = (b, hq, nq) if packed is None else (hq, nq)
    delta = torch.empty(shape, device=out.device, dtype=torch.float32)
    pre_m = 32 if interpreting() else 64
    rows = nq if packed is None else packed.max_q
    _launch(
        kernels.attn_bwd_preprocess_kernel, out, (cdiv(rows, pre_m), b * hq),
        (out, dout, delta, _cu(packed, out)[0], *out.stride(), *dout.stride(), hq, nq, dv),
        {"BLOCK_M": pre_m, "BLOCK_DV": meta["BLOCK_DV"], "INPUT_PRECISION": meta["INPUT_PRECISION"],
         "VARLEN": packed is not None},
        4, record,
    )  # fmt: skip
    if dlse is not None:
        delta = delta - dlse.float()
    return delta


# Cached launch plans (issue 17, item 3). An eager call on CUDA tensors is keyed by
# everything that decides its launch except the tensors' addresses: shapes, strides,
# dtypes, each tensor's 16-byte alignment (Triton specializes pointers on it), the
# scalars, the devices, fp32's matmul precision and the active tuning override. The
# first call of a key goes the full way (configuration, flags, Triton's binder, which
# compiles or finds the kernel) and marks the key; the second goes the full way too and
# records a plan: the compiled kernel, its grid and every non-tensor argument
# (launch.CachedLaunch). Later calls of the key allocate the outputs and launch the
# plan. So a shape that changes every call (a KV cache grown by concatenation) pays the
# full path, as before, and never the recording. A plan is made only from a launch by
# the real launcher with wrap_triton off (plain eager calls, the ops' eager path);
# traced, compiled and interpreted calls never use one. The table is cleared when it
# reaches _MAX_PLANS keys.
_PLANS: dict[tuple, Any] = {}
_MAX_PLANS = 1024
_SEEN = object()  # the mark of a key met once


def _lookup(key: tuple | None) -> tuple[Any, tuple | None]:
    """(plan, key to record under) for one call: the plan where there is one; else
    None and, on the key's second call, the key (the full path then records a plan);
    on its first, None and None (the key is marked). A call with no key (None: it may
    not use plans) gets None and None."""
    if key is None:
        return None, None
    entry = _PLANS.get(key)
    if entry is None:
        _remember(key, _SEEN)
        return None, None
    if entry is _SEEN:
        return None, key
    return entry, None


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % 16 == 0


def _plan_key(
    kind: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    seed: torch.Tensor | None, scalars: tuple, *extra: Any,
) -> tuple | None:  # fmt: skip
    """The plan key of one call (see _PLANS), or None where the call may not use plans:
    tensors not on CUDA, a launcher replaced by a tool (aot_check, tests that record
    launches), or wrap_triton enabled (tracing; the caller checks that)."""
    if not q.is_cuda or _launcher is not _default_launcher:
        return None
    dtype = q.dtype
    # One tuple per call, hashed once by the lookup: kept flat and built from C calls
    # (the host time of a tiny call is the point of plans).
    return (
        kind, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
        dtype, k.dtype, v.dtype,
        q.data_ptr() % 16 == 0, k.data_ptr() % 16 == 0, v.data_ptr() % 16 == 0,
        None if mask is None else (mask.shape, mask.stride(), mask.dtype, _aligned(mask)),
        None if seed is None else _aligned(seed),
        scalars, extra, torch._C._cuda_getDevice(), q.get_device(),
        dtype == torch.float32 and torch.get_float32_matmul_precision(),
        tuning._CURRENT.get(),
    )  # fmt: skip


def backward_plan_key(
    kind: str, dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    mask: torch.Tensor | None, seed: torch.Tensor | None, out: torch.Tensor,
    lse: torch.Tensor, dlse: torch.Tensor | None, scalars: tuple, *extra: Any,
) -> tuple | None:  # fmt: skip
    """:func:`_plan_key` of a backward call: the forward's tensors plus dout's layout,
    out's strides, the alignments of dout, out and lse, and whether a dlse comes."""
    return _plan_key(
        kind, q, k, v, mask, seed, scalars, dout.shape, dout.stride(), dout.dtype,
        _aligned(dout), out.stride(), _aligned(out), _aligned(lse), dlse is None, *extra,
    )  # fmt: skip


def _remember(key: tuple, plan: Any) -> None:
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.clear()
    _PLANS[key] = plan


def clear_plans() -> None:
    """Forget every cached launch plan (the next call of each key takes the full path)."""
    _PLANS.clear()


class _ForwardPlan:
    """A forward call's outputs' shapes and its cached launch (see _PLANS)."""

    __slots__ = ("device", "dtype", "launch", "out_shape", "rows_dtype", "rows_shape")

    def __init__(self, launch: CachedLaunch, out: torch.Tensor, rows: torch.Tensor | None) -> None:
        """``rows``: what the kernel wrote per query row (the lse, or a float mask's
        row stats), None without one."""
        self.launch, self.out_shape, self.dtype, self.device = (
            launch,
            out.shape,
            out.dtype,
            out.device,
        )
        self.rows_shape = None if rows is None else rows.shape
        self.rows_dtype = None if rows is None else rows.dtype

    def __call__(self, q, k, v, mask, seed, key_ranges=None, public_lse=True):  # type: ignore[no-untyped-def]
        """(out, lse, stats) as :func:`_forward`'s. ``key_ranges``: this call's ranges
        where the plan is a key-range call's (its CuK slot; the plan holds no earlier
        call's ranges)."""
        out = torch.empty(self.out_shape, dtype=self.dtype, device=self.device)
        m, s = q if mask is None else mask, q if seed is None else seed
        cu_k = q if key_ranges is None else key_ranges
        if self.rows_shape is None:
            self.launch(q, k, v, m, s, out, q, q, cu_k)
            return out, None, None
        rows = torch.empty(self.rows_shape, dtype=self.rows_dtype, device=self.device)
        self.launch(q, k, v, m, s, out, rows, q, cu_k)
        return _with_lse(out, rows, self.rows_dtype is torch.int64, public_lse)


def _forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    scalars: tuple,
    store_lse: bool,
    key: tuple | None,
    packed: Packed | None = None,
    key_ranges: torch.Tensor | None = None,
    public_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """The forward's full path (see :func:`_fwd_rows`): (out, lse, stats), stats the
    packed row stats of a float mask's call (see _keeps_row_stats), else None; lse and
    stats None without ``store_lse``; the lse None for such a call without
    ``public_lse`` (its stats kept, no lse derived). Records a plan under ``key``
    where it is given and the launch returned a compiled kernel. ``packed``: q, k, v are
    :meth:`Packed.view` views; out is then (Tq, Hq, Dv) and lse (Hq, Tq).
    ``key_ranges``: int32 (B, 2), the keys each batch entry sees (glossary, "Key
    ranges"; no mask then)."""
    causal, bottom_right, window_left, window_right, softcap, scale, dropout_p = scalars
    b, hq, nq, d = q.shape
    hkv, nk, dv = k.shape[1], k.shape[2], v.shape[-1]
    row_stats = _keeps_row_stats(mask)
    if packed is None:
        out, lse, empty = _forward_outputs(q, k, v, store_lse, row_stats)
        out_view, rows = out, nq
    else:
        out, lse, empty = packed.outputs(q, k, v, store_lse)
        out_view, rows = packed.view(out), packed.max_q
    if empty:
        return _with_lse(out, lse, row_stats, public_lse)
    c = _setup(q, v, mask, nk, causal, bottom_right, window_left, window_right, softcap,
               scale, dropout_p, packed)  # fmt: skip
    varlen = _varlen(packed, key_ranges)
    tma_ok = _tma_eligible(c, varlen, q, k, v, out_view)
    gluon_ok = tma_ok and _gluon_eligible(c, q)
    block_d = max(c.meta["BLOCK_D"], c.meta["BLOCK_DV"])
    cfg = launch_config(
        "fwd", block_d, q.element_size(), causal,
        _capability(q.device), interpreting(), c.walk, lean=mask is None, tma=tma_ok,
        gluon=gluon_ok, bool_mask=c.meta["MASK_KIND"] == 1,
    )  # fmt: skip
    grid = (cdiv(rows, cfg.block_m), b * hq)
    args = (
        q, k, v, c.mask, q if seed is None else seed, out_view, q if lse is None else lse,
        *_cu(packed, q, key_ranges), *q.stride(), *k.stride(), *v.stride(), *c.mask_strides,
        *out_view.stride(), hq, hq // hkv, nq, nk, d, dv, *c.scalars,
    )  # fmt: skip
    meta = {
        **c.meta, **cfg.meta(), "FOLD_SCALE": c.fold_scale,
        **_edge_segments(True, nq, nk, cfg, causal, window_left, window_right, ragged=varlen > 0),
        **_row_strides(K=k, V=v), "STORE_LSE": store_lse, "VARLEN": varlen,
        "HEAVY_FIRST": _heavy_first(causal, block_d),
    }  # fmt: skip
    if cfg.gluon and gluon_ok:
        kernel, tma = kernels_gluon.attn_fwd_gluon_kernel, True
        meta["STAGES"] = cfg.num_stages
    else:
        tma = cfg.tma and tma_ok
        kernel = kernels_tma.attn_fwd_tma_kernel if tma else kernels.attn_fwd_kernel
    with _scratch_allocator() if tma else contextlib.nullcontext():
        compiled = _launcher(kernel, q)[grid](*args, **meta)
    if key is not None and _is_compiled(compiled):
        launch = CachedLaunch(kernel, compiled, grid, args, meta, tensors=9)
        _remember(key, _ForwardPlan(launch, out, lse))
    return _with_lse(out, lse, row_stats, public_lse)


def _tma_eligible(c: _Setup, varlen: int, *tensors: torch.Tensor, max_d: int = 128) -> bool:
    """Whether a forward may run kernels_tma.attn_fwd_tma_kernel (where its launch row
    asks for TMA loads, LaunchConfig.tma): a dense call with no attn_mask and no dropout,
    2-byte dtypes, power-of-two head dims up to ``max_d`` (128: the forward's sizes
    measured; the Gluon backward passes 256), not traced (the kernel builds its tensor
    descriptors in global scratch, which the launch allocates: Inductor's launches of
    traced kernels are not known to), on sm_90+ or in the interpreter, and ``tensors``
    laid out as TMA requires: unit stride along the head dim, rows that do not overlap,
    the base address and every stride of a dim longer than 1 a multiple of 16 bytes."""
    meta = c.meta
    if (
        varlen or meta["MASK_KIND"] or meta["HAS_DROPOUT"] or not meta["EVEN_D"]
        or is_wrap_triton_enabled()
    ):  # fmt: skip
        return False
    q = tensors[0]
    if q.element_size() != 2 or max(meta["BLOCK_D"], meta["BLOCK_DV"]) > max_d:
        return False
    if not (interpreting() or (_capability(q.device) or (0,)) >= (9, 0)):
        return False
    for t in tensors:
        # A descriptor's row stride must span a row (rows expanded with stride 0, or
        # overlapping, are not a tiled tensor map's layout).
        if t.stride(3) != 1 or t.data_ptr() % 16 or (t.shape[2] > 1 and t.stride(2) < t.shape[3]):
            return False
        es = t.element_size()
        if any(size > 1 and stride * es % 16 for size, stride in zip(t.shape[:3], t.stride()[:3])):
            return False
    return True


def _gluon_eligible(c: _Setup, q: torch.Tensor) -> bool:
    """Whether a forward that :func:`_tma_eligible` admits may also run
    kernels_gluon.attn_fwd_gluon_kernel (where its launch row asks for it,
    LaunchConfig.gluon): D = Dv = 128, no softcap, the scale folded into the exponent
    (_Setup.fold_scale), on sm_90 (warpgroup MMA is Hopper's: sm_100 has none), with a
    Triton that has Gluon's Hopper API. Gluon kernels do not run in the interpreter."""
    meta = c.meta
    return (
        meta["BLOCK_D"] == meta["BLOCK_DV"] == 128 and not meta["HAS_SOFTCAP"] and c.fold_scale
        and not interpreting() and _capability(q.device) == (9, 0) and kernels_gluon is not None
    )  # fmt: skip


def _gluon_bwd_eligible(c: _Setup, lse: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether a backward's dK/dV or dQ may run kernels_gluon_bwd's kernel (where that
    role's launch row asks for it): ``tensors`` (q, k, v, dout) as
    :func:`_tma_eligible` admits them for a dense call, D = Dv = 128 or 256, no softcap, on
    sm_90 with Gluon's Hopper API, and lse rows that its 1-D descriptors can start at
    (16-byte aligned: an aligned lse and Nq % 4 == 0; on the H200 Nq = 1025 made the
    kernel fault)."""
    meta, q = c.meta, tensors[0]
    return (
        _tma_eligible(c, 0, *tensors, max_d=256) and meta["BLOCK_D"] == meta["BLOCK_DV"] in (128, 256)
        and not meta["HAS_SOFTCAP"] and not interpreting() and kernels_gluon_bwd is not None
        and _capability(q.device) == (9, 0) and lse.data_ptr() % 16 == 0
        and q.shape[2] % 4 == 0
    )  # fmt: skip


def _tma_scratch(size: int, alignment: int, stream: int | None) -> torch.Tensor:
    """Global scratch for a launch (Triton's allocator protocol): the in-kernel tensor
    descriptors of kernels_tma and kernels_gluon, on the current CUDA device, from PyTorch's allocator
    (stream-ordered, so reuse after the launch is safe; graph capture pools it)."""
    return torch.empty(size, dtype=torch.int8, device="cuda")


@contextlib.contextmanager
def _scratch_allocator() -> Iterator[None]:
    """Inside the block, Triton's launches allocate global scratch with
    :func:`_tma_scratch` unless the caller set an allocator of its own. Triton's
    allocator is a context variable (triton.set_allocator sets it for good): it is set
    here for the launch only, so the caller's context is left as it was."""
    if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
        yield
        return
    token = _allocation._allocator.set(_tma_scratch)
    try:
        yield
    finally:
        _allocation._allocator.reset(token)


def _is_compiled(kernel: Any) -> bool:
    from triton.compiler import CompiledKernel

    return isinstance(kernel, CompiledKernel)


def _fwd_impl(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Forward. q (B, Hq, Nq, D), k (B, Hkv, Nk, D), v (B, Hkv, Nk, Dv), mask None or
    broadcastable to (B, Hq, Nq, Nk), seed None or int64 (1,) on q's device.
    Window sides: -1 = unbounded; softcap 0 = none. Returns out (B, Hq, Nq, Dv) in q's
    dtype, lse (B, Hq, Nq) float32 (natural log, -inf for rows with no key) and the
    row stats the backward reads in the lse's place (B, Hq, Nq) int64 where the mask is
    a float one (see _keeps_row_stats), else an empty int64 tensor (an op's outputs
    are tensors, and may not alias each other)."""
    return op_outputs(*_fwd_rows(q, k, v, mask, seed, causal, bottom_right, window_left,
                                 window_right, softcap, scale, dropout_p))  # type: ignore[no-any-return]  # fmt: skip


def _fwd_rows(q, k, v, mask, seed, *scalars, public_lse=True):  # type: ignore[no-untyped-def]
    """:func:`_fwd_impl`'s (out, lse, stats), stats None where the backward reads the
    lse itself; DirectAttention's forward. Eager calls on CUDA reuse a cached launch
    plan (see _PLANS). Without ``public_lse`` a float mask's call derives no lse from
    its stats (None: :func:`flash_attention` without ``return_lse``)."""
    key = None if is_wrap_triton_enabled() else _plan_key("fwd", q, k, v, mask, seed, scalars, True)
    plan, key = _lookup(key)
    if plan is not None:
        return plan(q, k, v, mask, seed, public_lse=public_lse)
    return _forward(q, k, v, mask, seed, scalars, True, key, public_lse=public_lse)


_fwd_rows_without_lse = functools.partial(_fwd_rows, public_lse=False)


def _fwd_no_grad(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    scalars: tuple,
    store_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An eager call on plain tensors that records no gradient: (out, lse), the forward
    without an autograd node, and without an lse unless ``store_lse``."""
    plan, key = _lookup(_plan_key("fwd", q, k, v, mask, seed, scalars, store_lse))
    if plan is not None:
        return plan(q, k, v, mask, seed)[:2]  # type: ignore[no-any-return]
    with set_wrap_triton_enabled(False):
        return _forward(q, k, v, mask, seed, scalars, store_lse, key)[:2]


def _bwd_impl(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    causal: bool,
    bottom_right: bool,
    window_left: int,
    window_right: int,
    softcap: float,
    scale: float,
    dropout_p: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward: (dq, dk, dv) shaped like (q, k, v). ``lse``: what the kernels read per
    query row, the forward's lse or, for a float mask's call, its row stats (see
    _keeps_row_stats). ``dlse`` (B, Hq, Nq) is the gradient reaching the returned lse,
    or None. Deterministic: no atomics.

    After the preprocess (delta), dK/dV and dQ run as two launches or as one merged
    launch, as :func:`configs.backward_launch` decides (a table by head dim;
    ``tuning.override(backward_launch=...)`` forces one), with the same two configurations and
    edge-segment flags either way; the gradients are bitwise the same."""
    scalars = (causal, bottom_right, window_left, window_right, softcap, scale, dropout_p)
    key = None
    if not is_wrap_triton_enabled():
        key = backward_plan_key("bwd", dout, q, k, v, mask, seed, out, lse, dlse, scalars)
    plan, key = _lookup(key)
    if plan is not None:
        return plan(dout, q, k, v, mask, seed, out, lse, dlse)  # type: ignore[no-any-return]
    return _bwd_full(dout, q, k, v, mask, seed, out, lse, dlse, scalars, key)


def _bwd_full(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    seed: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    scalars: tuple,
    key: tuple | None,
    packed: Packed | None = None,
    key_ranges: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward's full path (see :func:`_bwd_impl`); records a plan under ``key``
    where it is given and every launch returned a compiled kernel. ``packed``: dout, q,
    k, v, out are :meth:`Packed.view` views, lse and dlse (Hq, Tq), and the gradients
    come back packed, shaped like the tensors the views show. ``key_ranges``: as
    :func:`_forward`'s."""
    causal, bottom_right, window_left, window_right, softcap, scale, dropout_p = scalars
    b, hq, nq, d = q.shape
    hkv, nk, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    if packed is None:
        dq, dk, dv, empty = _grad_outputs(q, k, v)
        if empty:
            return dq, dk, dv
        if key_ranges is not None:  # keys outside a range get no program's store
            dk.zero_()
            dv.zero_()
        views, rows_q, rows_k = (dq, dk, dv), nq, nk
    else:
        # Every packed row belongs to one sequence, whose programs store it (zeros where
        # the sequence has no keys or no queries).
        dq, dk, dv = (torch.empty((t.shape[2], t.shape[1], t.shape[3]), device=t.device, dtype=t.dtype)
                      for t in (q, k, v))  # fmt: skip
        if b * hq * packed.max_q == 0 or nk == 0:
            return dq.zero_(), dk.zero_(), dv.zero_()
        views, rows_q, rows_k = (
            tuple(packed.view(t) for t in (dq, dk, dv)),
            packed.max_q,
            packed.max_k,
        )
    c = _setup(q, v, mask, nk, causal, bottom_right, window_left, window_right, softcap,
               scale, dropout_p, packed)  # fmt: skip
    record: list | None = [] if key is not None else None
    delta = _delta(out, dout, dlse, c.meta, record, packed)
    block_d = max(c.meta["BLOCK_D"], c.meta["BLOCK_DV"])
    seed_t = q if seed is None else seed
    cu_q, cu_k = _cu(packed, q, key_ranges)
    esize, lean = q.element_size(), mask is None
    band = (causal, window_left, window_right)
    varlen = _varlen(packed, key_ranges)
    ragged = varlen > 0
    # The cheap checks first: the full ones read every tensor's strides.
    gluon_ok = (
        lean and not ragged and esize == 2 and block_d in (128, 256)
        and _gluon_bwd_eligible(c, lse, q, k, v, dout)
    )  # fmt: skip
    kv_cfg, q_cfg = backward_configs(block_d, esize, causal, _capability(q.device),
                                     interpreting(), c.walk, lean, gluon=gluon_ok)  # fmt: skip
    mode = backward_launch(kv_cfg, q_cfg, block_d, esize, lean)
    if mode != "split":
        # One launch; the kernel derives each program's role and tile from its ids alone
        # (grids in kernels.attn_bwd_kernel's docstring).
        kv_tiles, q_tiles = cdiv(rows_k, kv_cfg.block_n), cdiv(rows_q, q_cfg.block_m)
        if mode == "merged_heads":
            grid: tuple[int, ...] = (kv_tiles + (hq // hkv) * q_tiles, b * hkv)
        else:
            grid = (kv_tiles * b * hkv + q_tiles * b * hq,)
        args = (
            q, k, v, c.mask, seed_t, dout, lse, delta, *views, cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *dout.stride(),
            *views[0].stride(), *views[1].stride(), *views[2].stride(),
            b, hq, hkv, hq // hkv, nq, nk, rows_q, rows_k, d, dv_dim, *c.scalars,
        )  # fmt: skip
        meta = {
            **c.meta, **merged_meta(kv_cfg, q_cfg, mode),
            **_edge_segments(False, nq, nk, kv_cfg, *band, prefix="KV_", ragged=ragged),
            **_edge_segments(True, nq, nk, q_cfg, *band, prefix="Q_", ragged=ragged),
            **_row_strides(Q=q, DO=dout, K=k, V=v), "VARLEN": varlen,
        }  # fmt: skip
        _launch(kernels.attn_bwd_kernel, q, grid, args, meta, 13, record)
    else:
        args = (
            q, k, v, c.mask, seed_t, dout, lse, delta, views[1], views[2], cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *dout.stride(),
            *views[1].stride(), *views[2].stride(), hq, hkv, hq // hkv, nq, nk, d, dv_dim,
            *c.scalars,
        )  # fmt: skip
        meta = {**c.meta, **kv_cfg.meta(), **_edge_segments(False, nq, nk, kv_cfg, *band, ragged=ragged),
                **_row_strides(Q=q, DO=dout), "VARLEN": varlen}  # fmt: skip
        _launch_kernel_of_row(
            kernels.attn_bwd_dkdv_kernel, getattr(kernels_gluon_bwd, "attn_bwd_dkdv_gluon_kernel", None),
            kv_cfg, gluon_ok, q, (cdiv(rows_k, kv_cfg.block_n), b * hkv), args, meta, 12, record,
        )  # fmt: skip
        args = (
            q, k, v, c.mask, seed_t, dout, lse, delta, views[0], cu_q, cu_k,
            *q.stride(), *k.stride(), *v.stride(), *c.mask_strides, *dout.stride(),
            *views[0].stride(), hq, hq // hkv, nq, nk, d, dv_dim, *c.scalars,
        )  # fmt: skip
        meta = {**c.meta, **q_cfg.meta(), **_edge_segments(True, nq, nk, q_cfg, *band, ragged=ragged),
                **_row_strides(K=k, V=v), "VARLEN": varlen, "HEAVY_FIRST": _heavy_first(causal, block_d)}  # fmt: skip
        _launch_kernel_of_row(
            kernels.attn_bwd_dq_kernel, getattr(kernels_gluon_bwd, "attn_bwd_dq_gluon_kernel", None),
            q_cfg, gluon_ok, q, (cdiv(rows_q, q_cfg.block_m), b * hq), args, meta, 11, record,
        )  # fmt: skip
    if key is not None and record and all(x is not None for x in record):
        _remember(key, _BackwardPlan(record, dq, dk, dv, delta.shape))
    return dq, dk, dv


def _planned_delta(preprocess, out, dout, dlse, shape):  # type: ignore[no-untyped-def]
    """:func:`_delta` through a plan's recorded preprocess launch (its tensors: out,
    dout, delta, CuQ), ``shape`` the delta's."""
    delta = torch.empty(shape, dtype=torch.float32, device=out.device)
    preprocess(out, dout, delta, out)
    return delta if dlse is None else delta - dlse.float()


class _BackwardPlan:
    """A backward call's gradients' shapes and its cached launches (see _PLANS): the
    preprocess, then the merged launch or the dK/dV and dQ launches."""

    __slots__ = ("delta_shape", "device", "dtypes", "launches", "shapes")

    def __init__(self, launches: list, dq, dk, dv, delta_shape) -> None:  # type: ignore[no-untyped-def]
        self.launches = tuple(launches)
        self.shapes = (dq.shape, dk.shape, dv.shape)
        self.dtypes = (dq.dtype, dk.dtype, dv.dtype)
        self.device, self.delta_shape = dq.device, delta_shape

    def __call__(self, dout, q, k, v, mask, seed, out, lse, dlse, key_ranges=None):  # type: ignore[no-untyped-def]
        """``key_ranges``: as :meth:`_ForwardPlan.__call__`'s; dK and dV then start at
        zero, as on the full path (keys outside every range get no program's store)."""
        device = self.device
        dq, dk, dv = (
            torch.empty(s, dtype=t, device=device) for s, t in zip(self.shapes, self.dtypes)
        )
        cu_k = q
        if key_ranges is not None:
            dk.zero_()
            dv.zero_()
            cu_k = key_ranges
        delta = _planned_delta(self.launches[0], out, dout, dlse, self.delta_shape)
        m = q if mask is None else mask
        s = q if seed is None else seed
        if len(self.launches) == 2:  # merged
            self.launches[1](q, k, v, m, s, dout, lse, delta, dq, dk, dv, q, cu_k)
        else:
            self.launches[1](q, k, v, m, s, dout, lse, delta, dk, dv, q, cu_k)
            self.launches[2](q, k, v, m, s, dout, lse, delta, dq, q, cu_k)
        return dq, dk, dv


def _define(name: str, impl):  # type: ignore[no-untyped-def]
    """Register ``impl`` as the op ``name``.

    On the GPU: ``triton_op``, which torch.compile traces through to the wrapped kernels
    (its fake implementation is ``impl`` on fake tensors, where wrap_triton launches
    nothing). Under the interpreter the kernels cannot be traced, so the op is an opaque
    ``custom_op`` whose fake implementation is again ``impl`` (launches are skipped on
    fake tensors, see :func:`_launcher`).
    """
    if interpreting():
        op = torch.library.custom_op(name, mutates_args=())(impl)
        op.register_fake(impl)
        return op
    return triton_op(name, mutates_args={})(impl)


triton_flash_fwd = _define("attnhub::triton_flash_fwd", _fwd_impl)
triton_flash_bwd = _define("attnhub::triton_flash_bwd", _bwd_impl)

_SCALARS = (
    "causal",
    "bottom_right",
    "window_left",
    "window_right",
    "softcap",
    "scale",
    "dropout_p",
)


def _setup_context(ctx, inputs, output) -> None:  # type: ignore[no-untyped-def]
    q, k, v, mask, seed, *scalars = inputs
    out, lse, stats = output
    ctx.save_for_backward(q, k, v, mask, seed, out, saved_rows(lse, stats))
    ctx.scalars = scalars
    ctx.tuning = tuning.current()


def _backward(ctx, dout, dlse, dstats):  # type: ignore[no-untyped-def]
    q, k, v, mask, seed, out, lse = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    with tuning.restored(ctx.tuning):
        dq, dk, dv = triton_flash_bwd(dout, q, k, v, mask, seed, out, lse, dlse, *ctx.scalars)
    return (dq, dk, dv, None, None) + (None,) * len(_SCALARS)


triton_flash_fwd.register_autograd(_backward, setup_context=_setup_context)

# The backward kernels compute gradients, not a graph of them: a gradient of a gradient
# (double backward: torch.autograd.grad(..., create_graph=True), then differentiating
# its result) is not implemented. PyTorch's fused kernels raise "derivative for ... is
# not implemented" there; so do these, on both paths (DirectAttention below, and the
# registered ops), instead of handing back gradients that autograd treats as constants
# (a second derivative through them was silently missing every attention term).
DOUBLE_BACKWARD_ERROR = (
    "derivative for attnhub's Triton attention backward is not implemented (double "
    "backward: differentiating a gradient taken with create_graph=True); "
    "backend='torch_reference' computes attention with differentiable gradients"
)


def raise_double_backward(ctx, *grads):  # type: ignore[no-untyped-def]
    """The registered autograd of the backward ops: differentiating them raises."""
    raise RuntimeError(DOUBLE_BACKWARD_ERROR)


triton_flash_bwd.register_autograd(raise_double_backward)


class _GradientsOfNoGraph(torch.autograd.Function):
    """``apply(count, *tensors)`` returns ``tensors[:count]`` (the gradients) unchanged,
    as outputs of one node with an edge to every tensor that requires grad: the
    gradients and the inputs they were computed from. Its backward raises
    DOUBLE_BACKWARD_ERROR, so differentiating a gradient with respect to any of those
    inputs raises, as PyTorch's fused kernels do. (``DelayedError``, what
    ``torch.autograd.function.once_differentiable`` uses, links the gradients to fresh
    leaves only: a second derivative with respect to k or v never reaches it, and
    comes back silently without the attention terms.)"""

    @staticmethod
    def forward(ctx, count, *tensors):  # type: ignore[no-untyped-def]
        return tuple(t.view_as(t) for t in tensors[:count])

    @staticmethod
    def backward(ctx, *grads):  # type: ignore[no-untyped-def]
        raise RuntimeError(DOUBLE_BACKWARD_ERROR)


def once_differentiable(
    grads: tuple[torch.Tensor, ...], *inputs: torch.Tensor | None
) -> tuple[torch.Tensor, ...]:
    """``grads`` as computed, unless autograd records a graph through the backward
    (create_graph=True: grad mode is on inside it) and one of ``inputs`` (the incoming
    gradients and the saved tensors) requires grad: then the same values, whose
    differentiation raises DOUBLE_BACKWARD_ERROR (:class:`_GradientsOfNoGraph`)."""
    if not torch.is_grad_enabled():
        return grads
    needed = [t for t in inputs if t is not None and t.requires_grad]
    if not needed:
        return grads
    return _GradientsOfNoGraph.apply(len(grads), *grads, *needed)


# Whether a call on these tensors may bypass the op (see the module docstring): plain
# tensors in plain eager mode, nothing that would want to see the op.
direct = plain_eager


class DirectAttention(torch.autograd.Function):
    """An op's forward and backward implementations run as an autograd.Function.

    ``apply(fwd_impl, bwd_impl, extra, q, k, v, mask, seed, *scalars)`` computes
    ``fwd_impl(q, k, v, mask, seed, *extra, *scalars) -> (out, lse, stats)`` and returns
    (out, lse), lse None where fwd_impl derives none (a float mask's call that returns
    no lse: :func:`flash_attention`); the backward calls ``bwd_impl(dout, q, k, v,
    mask, seed, *extra, out, rows, dlse, *scalars)``, rows the stats where there are
    some (a float mask's call: see _keeps_row_stats), else the lse, as the op's
    registered autograd does.
    ``extra`` holds what is neither a differentiable input nor a scalar (the
    block-sparse index tensors).
    """

    @staticmethod
    def forward(ctx, fwd_impl, bwd_impl, extra, q, k, v, mask, seed, *scalars):  # type: ignore[no-untyped-def]
        # Launch the raw kernels: wrap_triton would route them through its tracing
        # machinery, which only torch.compile needs.
        with set_wrap_triton_enabled(False):
            out, lse, stats = fwd_impl(q, k, v, mask, seed, *extra, *scalars)
        # An output that gets no gradient (lse, usually) arrives as None instead of a
        # tensor of zeros: no fill and no subtraction in the backward.
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, mask, seed, out, lse if stats is None else stats)
        ctx.impl = (bwd_impl, extra, scalars)
        ctx.tuning = tuning.current()  # the backward's too (tuning.restored)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):  # type: ignore[no-untyped-def]
        q, k, v, mask, seed, out, rows = ctx.saved_tensors
        bwd_impl, extra, scalars = ctx.impl
        if dout is None:
            dout = torch.zeros_like(out)
        with set_wrap_triton_enabled(False), tuning.restored(ctx.tuning):
            grads = bwd_impl(dout, q, k, v, mask, seed, *extra, out, rows, dlse, *scalars)
        dq, dk, dv = once_differentiable(grads, dout, dlse, q, k, v, mask)
        return (None, None, None, dq, dk, dv, None, None) + (None,) * len(scalars)


def call_scalars(
    q: torch.Tensor,
    causal: bool,
    bottom_right: bool,
    window: tuple[int | None, int | None] | None,
    softcap: float | None,
    scale: float | None,
    dropout_p: float,
) -> tuple[torch.Tensor | None, tuple]:
    """(seed, scalars) of one call, as the ops take them (both triton backends): the
    dropout seed (int64 (1,) on q's device, drawn from PyTorch's generator, or None
    without dropout) and (causal, bottom_right, window_left, window_right, softcap,
    scale, dropout_p) with the ops' encodings (NO_WINDOW, softcap 0 = none, the
    default scale 1/sqrt(D) resolved)."""
    left, right = window if window is not None else (None, None)
    seed = None
    if dropout_p > 0.0:
        seed = torch.randint(0, 2**62, (1,), dtype=torch.int64, device=q.device)
    scalars = (
        causal, bottom_right,
        NO_WINDOW if left is None else int(left), NO_WINDOW if right is None else int(right),
        float(softcap or 0.0), float(scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])),
        float(dropout_p),
    )  # fmt: skip
    return seed, scalars


def _records_no_gradient(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether a call on plain tensors needs no autograd node: no input requires grad
    (or grad mode is off; the mask gets no gradient: mask_grad = False) and no forward-AD
    level is open (dual tensors then go through DirectAttention, as they always did)."""
    return (
        not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and forward_ad._current_level < 0
    )


def apply_direct(
    fwd_impl: Any, bwd_impl: Any, extra: tuple, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, scalars: tuple, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:  # fmt: skip
    """(out, lse) of a maskless, dropout-free call through ``fwd_impl`` / ``bwd_impl``
    (DirectAttention's pair, ``extra`` their layout argument): without an autograd node
    and without an lse unless ``return_lse`` where the call records no gradient, else
    through :class:`DirectAttention` (the lse kept for the backward)."""
    if _records_no_gradient(q, k, v):
        with set_wrap_triton_enabled(False):
            return fwd_impl(q, k, v, None, None, *extra, *scalars, store_lse=return_lse)[:2]  # type: ignore[no-any-return]
    return DirectAttention.apply(fwd_impl, bwd_impl, extra, q, k, v, None, None, *scalars)  # type: ignore[no-any-return]


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None = None,
    *,
    causal: bool = False,
    bottom_right: bool = False,
    window: tuple[int | None, int | None] | None = None,
    softcap: float | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    return_lse: bool = True,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Differentiable attention through the ops; returns (out, lse), lse None where
    ``return_lse`` is False (then, on a call that records no gradient, it is not
    computed at all).

    Shapes as :func:`triton_flash_fwd`. Dropout draws its Philox seed from PyTorch's
    generator for q's device, so ``torch.manual_seed`` reproduces it.
    """
    seed, scalars = call_scalars(q, causal, bottom_right, window, softcap, scale, dropout_p)
    if direct(q, k, v, mask):
        if _records_no_gradient(q, k, v):
            return _fwd_no_grad(q, k, v, mask, seed, scalars, return_lse)
        # Without return_lse a float mask's call derives no lse from its row stats (the
        # backward reads the stats): the Function's lse output is then None.
        fwd = _fwd_rows if return_lse else _fwd_rows_without_lse
        out, lse = DirectAttention.apply(fwd, _bwd_impl, (), q, k, v, mask, seed, *scalars)
    else:
        out, lse, _ = triton_flash_fwd(q, k, v, mask, seed, *scalars)
    return out, (lse if return_lse else None)
