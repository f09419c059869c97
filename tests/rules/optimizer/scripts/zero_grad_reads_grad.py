"""`zero_grad(set_to_none=False)` followed by code that writes into the zeroed gradients before backward
(a weight decay added by hand): with set_to_none those gradients are None there, so the fix is unsafe."""

import torch

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(16, 32)
for _ in range(8):
    opt.zero_grad(set_to_none=False)
    for p in model.parameters():
        if p.grad is not None:  # expect: grad_use
            p.grad.add_(p.detach(), alpha=1e-4)
    model(x).pow(2).mean().backward()
    opt.step()
