"""Host time of attnhub's own path for a decoding loop's calls, by layer (no kernel).

A model's decoding step makes one attention call per layer; the first sees a cache one
key longer and a new padding mask, the others repeat its shapes. This times each
call's wall clock through ``attnhub.attention`` and through a patched
``F.scaled_dot_product_attention`` on a registry holding one backend that returns at
once, so that what is timed is attnhub's dispatch and memos alone (validation, the
call cache, the guards), on any machine::

    python benchmarks/step_host_probe.py [--steps 60] [--repeats 6] [--fresh]

Shapes: B=8, 16 heads, D=128, one query row, a bool key mask (B, 1, 1, Nk), caches
of 1000 keys and up, 8 layers. ``--fresh``: each repeat's key lengths are new (as a
new prompt's are); else every repeat replays the first one's (as a benchmark's runs
do). Prints the median microseconds per call for each layer, per way.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import attnhub
from attnhub import dispatch
from attnhub import registry as registry_module
from attnhub.backend import Backend
from attnhub.registry import BackendRegistry

LAYERS = 8


class _Returns(Backend):
    """Serves every call by returning its query: no kernel, no allocation."""

    name = "returns"
    devices = frozenset({"cpu", "cuda"})
    dtypes = frozenset({torch.float32, torch.bfloat16, torch.float16})
    causal_alignments = frozenset({"top_left", "bottom_right"})
    mask_kinds = frozenset({"none", "bool", "float"})
    memory = "linear"
    priority = 50

    def forward(self, query, key, value, attn_mask, params):  # type: ignore[no-untyped-def]
        return query


def per_layer_us(way: str, steps: int, repeats: int, fresh: bool) -> list[float]:
    """Median host microseconds of each layer's call over every repeat but the first."""
    q = torch.randn(8, 16, 1, 128)
    times: list[list[float]] = [[] for _ in range(LAYERS)]
    for repeat in range(repeats):
        for step in range(steps):
            n = 1000 + step + (repeat * steps if fresh else 0)
            v = torch.empty(8, 16, n, 128)
            mask = torch.ones(8, 1, 1, n, dtype=torch.bool)
            caches = [torch.empty(8, 16, n, 128) for _ in range(LAYERS)]
            for layer, k in enumerate(caches):
                start = time.perf_counter()
                if way == "attention":
                    attnhub.attention(q, k, v, mask, backend="returns")
                else:
                    F.scaled_dot_product_attention(q, k, v, mask)
                if repeat:
                    times[layer].append((time.perf_counter() - start) * 1e6)
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--fresh", action="store_true", help="new key lengths every repeat")
    args = parser.parse_args()
    registry = BackendRegistry()
    registry.add(_Returns())
    registry_module._registry = registry
    dispatch.clear_cache()
    print(f"host us per call by layer ({'fresh' if args.fresh else 'repeated'} key lengths)")
    for way in ("attention", "patch"):
        if way == "patch":
            with attnhub.patch(backend="returns"):
                row = per_layer_us(way, args.steps, args.repeats, args.fresh)
        else:
            row = per_layer_us(way, args.steps, args.repeats, args.fresh)
        print(f"{way:10s}" + "".join(f"{us:7.1f}" for us in row))


if __name__ == "__main__":
    main()
