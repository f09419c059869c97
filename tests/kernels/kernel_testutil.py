"""Helpers shared by the kernel tests (imported by name: tests/kernels is on sys.path under pytest)."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (the plain norm of the difference when ref is 0); no NaN allowed."""
    out, ref = out.double(), ref.double()
    assert not torch.isnan(out).any(), "NaN in output"
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def grad_of(fn, x: torch.Tensor, dy: torch.Tensor, *others: torch.Tensor):
    """(fn(x, *others) detached, gradients w.r.t. x and every other tensor that requires grad)."""
    x = x.detach().clone().requires_grad_()
    y = fn(x, *others)
    inputs = [x] + [o for o in others if o is not None and o.requires_grad]
    grads = torch.autograd.grad(y, inputs, dy)
    return y.detach(), grads


def record_launches(monkeypatch, keep=lambda launch, args: launch.meta):
    """Every kernel launch from here on appends `keep(launch, args)` to the returned list, then launches."""
    from opadvisor.kernels import _launch

    seen = []
    launch_call = _launch.Launch.__call__

    def recorded(self, args):
        seen.append(keep(self, args))
        launch_call(self, args)

    monkeypatch.setattr(_launch.Launch, "__call__", recorded)
    return seen
