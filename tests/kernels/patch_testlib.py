"""Helpers shared by the `opadvisor.patch` tests of each model family."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn as nn

import opadvisor
from opadvisor.patching import registry
from opadvisor.patching.shared import _Patcher


def fixes(model: nn.Module) -> set[str]:
    """The fixes `patch` installed on the model (its report's patched entries)."""
    return {fix for _, _, fix in opadvisor.patch_report(model).patched}


def forwards(model: nn.Module) -> dict[str, object]:
    """Each module's instance-level forward (None where the class's runs): what unpatch must restore."""
    return {name: m.__dict__.get("forward") for name, m in model.named_modules()}


def with_replacement(monkeypatch: pytest.MonkeyPatch, fix: str, forward: Callable[..., object]) -> None:
    """The patcher of `fix` with another replacement forward (a wrong one, say), for this test only."""
    patchers = [
        _Patcher(p.fix, p.check, forward, p.main_output) if p.fix.name == fix else p
        for p in registry.PATCHERS
    ]
    monkeypatch.setattr(registry, "PATCHERS", tuple(patchers))


def sgd_losses(model: nn.Module, inputs: Callable[[], dict[str, Any]], steps: int = 2) -> list[float]:
    """The losses of `steps` SGD steps (lr 0.1) of `model(**inputs())`."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = []
    for _ in range(steps):
        loss = model(**inputs()).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out
