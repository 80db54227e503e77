"""A float mask's values as kernels that take scores to log2 units can hold them.

PyTorch's CUDA kernels and FlexAttention's compiled kernel multiply scores by log2(e)
before exp2. A row whose every key a model's padding mask hides with finfo.min
(-3.4e38; bfloat16's -3.39e38) overflowed to -inf there, read as fully masked, and gave
zeros (H100, torch 2.11: torch_sdpa in float32, FlexAttention in bf16,
benchmarks/float_mask_probe.py) where the contract gives the mean of the values. Such
entries are clamped at +-2**127: times log2(e) that stays finite with room for the
scores added to it, and a row's entries beyond it tie, as they do at finfo.min.
(triton_flash needs no clamp: its kernels take a float mask's scores in natural units.)
"""

from __future__ import annotations

import torch

MASK_BOUND = 2.0**127


def clamp_beyond_log2_range(mask: torch.Tensor) -> torch.Tensor:
    """``mask`` with its finite entries clamped to +-MASK_BOUND; infinities kept, and
    a dtype that holds no such entry (float16) returned as it is. Any shape; also
    traceable inside a FlexAttention score_mod."""
    if torch.finfo(mask.dtype).max <= MASK_BOUND:
        return mask
    return torch.where(mask.isinf(), mask, mask.clamp(-MASK_BOUND, MASK_BOUND))
