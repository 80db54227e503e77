"""TEMPORARY: time block-sparse backward loop forms (ATTNHUB_BS_LOOP) per layout."""
import os, sys
sys.path.insert(0, os.path.dirname(__file__))
import torch, triton
import attnhub
from attnhub.backends.triton_flash import ops
from attnhub.bench import build_layout
from attnhub.timing import loop_ms
from block_sparse_probe import kernel_us

_orig = ops._launch
def _wrapped(*a, **kw):
    with ops._scratch_allocator():
        return _orig(*a, **kw)
ops._launch = _wrapped
import attnhub.backends.triton_blocksparse.ops as bso
bso._launch = _wrapped
dev = torch.device("cuda")
torch.manual_seed(0)
b, h, n, d = 2, 16, 8192, 128
q, k, v = (torch.randn(b, h, n, d, device=dev, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn_like(q)
out = attnhub.attention(q, k, v, backend="triton_flash")
dense_grads = torch.autograd.grad(out, (q, k, v), g)
loops = [int(x) for x in sys.argv[1].split(",")]
layouts = sys.argv[2].split(",")
for text in layouts:
    kind, param = text.split(":")
    layout = build_layout((kind, float(param)), n, 128, device=dev)
    ref = None
    for loop in loops:
        os.environ["ATTNHUB_BS_LOOP"] = str(loop)
        ops._PLANS.clear()
        out = attnhub.attention(q, k, v, block_sparse=layout, backend="triton_blocksparse")
        def bwd(out=out):
            return torch.autograd.grad(out, (q, k, v), g, retain_graph=True)
        grads = bwd()
        if ref is None:
            ref = grads
        diff = max((a.float() - r.float()).abs().max().item() for a, r in zip(grads, ref))
        extra = ""
        if text == "random:1":
            extra = " vs dense %.3g" % max((a.float() - r.float()).abs().max().item() for a, r in zip(grads, dense_grads))
        ms = loop_ms(bwd, dev, 20)
        ku = kernel_us(bwd)
        ks = "  ".join(f"{name.split('_kernel')[0][-12:]}={us:.0f}" for name, us in ku.items())
        print(f"{text} LOOP={loop}: bwd {ms:.3f} ms  maxdiff vs LOOP{loops[0]} {diff:.3g}{extra}  {ks}", flush=True)
