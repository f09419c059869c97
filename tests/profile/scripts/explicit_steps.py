"""A loop without a torch optimizer: steps are marked with opadvisor.step()."""

import torch

import opadvisor

w = torch.randn(8, 8, requires_grad=True)
for i in range(20):
    loss = (torch.randn(4, 8) @ w).pow(2).mean()
    loss.backward()
    with torch.no_grad():
        w -= 0.01 * w.grad
        w.grad = None
    opadvisor.step()
    print(f"step {i} loss {loss.item():.4f}")
