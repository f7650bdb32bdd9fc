import torch, time
from triton.testing import do_bench
x = torch.randn(65536, 1024, device="cuda").bfloat16()
W = torch.randn(64, 1024, device="cuda") * 0.02
hi = W.bfloat16(); r = W - hi.float(); mid = r.bfloat16(); lo = (r - mid.float()).bfloat16()
W3 = torch.cat([hi, mid, lo])
ref = x.double() @ W.double().t()
f32 = x.float() @ W.t()
try:
    l3 = torch.mm(x, W3.t(), out_dtype=torch.float32)
    s = l3[:, :64] + l3[:, 64:128] + l3[:, 128:]
    print("out_dtype ok", l3.dtype, "err split", ((s.double() - ref).norm() / ref.norm()).item(), "err fp32", ((f32.double() - ref).norm() / ref.norm()).item())
    print("t fp32 path", do_bench(lambda: x.float() @ W.t()), "t split", do_bench(lambda: torch.mm(x, W3.t(), out_dtype=torch.float32)))
    xr = x.clone().requires_grad_(); Wr = W3.clone().requires_grad_()
    torch.mm(xr, Wr.t(), out_dtype=torch.float32).sum().backward(); print("autograd ok", xr.grad.dtype, Wr.grad.dtype)
    g = torch.randn(65536, 192, device="cuda").bfloat16()
    print("dW fp32 out", torch.mm(g.t(), x, out_dtype=torch.float32).dtype, do_bench(lambda: torch.mm(g.t(), x, out_dtype=torch.float32)))
    cf = torch.compile(lambda a, b: torch.sigmoid(torch.mm(a, b.t(), out_dtype=torch.float32)))
    print("compiled ok", cf(x, W3).dtype)
except Exception as e:
    print("FAILED", type(e).__name__, str(e)[:300])
