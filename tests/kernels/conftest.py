"""Kernel tests run the Triton kernels: compiled on a GPU, through Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when it is first imported, so TRITON_INTERPRET=1 is set
here, at collection, before anything imports triton (`opadvisor.kernels` itself does not).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "triton was imported before tests/kernels/conftest.py could set TRITON_INTERPRET=1"
        )
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.fixture(params=DEVICES)
def device(request):
    return torch.device(request.param)


@pytest.fixture
def kernels_everywhere(monkeypatch):
    """Run the kernels for every size (on the GPU small tensors otherwise go to eager PyTorch)."""
    from opadvisor.kernels import dropout_add, softmax

    monkeypatch.setattr(softmax, "SMALL_NUMEL", 0)
    monkeypatch.setattr(dropout_add, "SMALL_NUMEL", 0)
