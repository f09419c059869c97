"""GPU-bound: a few large bf16 matrix products per step, no idle time between kernels."""

import torch

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
n = 8192 if device == "cuda" else 128
w = torch.randn(n, n, device=device, dtype=torch.bfloat16, requires_grad=True)
x = torch.randn(n, n, device=device, dtype=torch.bfloat16)
opt = torch.optim.SGD([w], lr=1e-6)
for _ in range(8):
    h = x
    for _ in range(4):
        h = h @ w
    h.float().mean().backward()
    opt.step()
    opt.zero_grad()
