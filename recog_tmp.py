import torch, time
from attnhub import mask_structure as ms
dev="cuda"
for shape in [(8,1,1,576),(8,1,1,4096),(8,1,512,512)]:
    m=torch.ones(*shape,dtype=torch.bool,device=dev)
    ms._recognize(m); torch.cuda.synchronize()
    n=50; s=time.perf_counter()
    for _ in range(n): p=ms._recognize(m)
    torch.cuda.synchronize()
    print(shape, "recognize %.1f us"%((time.perf_counter()-s)/n*1e6), p.describe() if p else None)
