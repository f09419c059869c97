"""Shared test setup: GPU tests are marked `gpu` and skipped where CUDA is not available; torchvision
(which timm brings where it is installed, as .ci/run does, and which lightning and transformers' Trainer
import when it is there) imports on a CPU-only torch, in this process and in every process the tests
start (cpu_torchvision/), and only there."""

from __future__ import annotations

import os
import runpy
from pathlib import Path

import pytest

_CPU_TORCHVISION = Path(__file__).resolve().parent / "cpu_torchvision"
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(_CPU_TORCHVISION), os.environ.get("PYTHONPATH")) if p
)
runpy.run_path(str(_CPU_TORCHVISION / "sitecustomize.py"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
