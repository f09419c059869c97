"""Launch-bound: a function of many tiny elementwise ops on a small tensor, and a per-parameter update loop."""

import torch

torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
weights = [torch.randn(256, device=device, requires_grad=True) for _ in range(8)]


def activation(x):  # expect: sparse_launch function
    for _ in range(50):
        x = x * 1.0001 + 0.001
        x = torch.tanh(x)
    return x


def sgd(params, lr=1e-3):
    with torch.no_grad():
        for p in params:
            p.add_(p.grad, alpha=-lr)
            p.grad = None


for _ in range(8):
    h = activation(weights[0])
    for w in weights[1:]:
        h = h + activation(w)
    h.sum().backward()
    sgd(weights)
    import opadvisor

    opadvisor.step()
