"""Kernel tests run the Triton kernels: compiled on a GPU, through Triton's interpreter on the CPU.

Triton decides between compiling and interpreting when it is first imported, so TRITON_INTERPRET=1 is set
here, at collection, before anything imports triton (`opadvisor.kernels` itself does not).
"""

from __future__ import annotations

import os

import pytest
import torch

# The variable stays set for the rest of the session: later tests that run the kernels on CPU tensors
# (rewritten examples, say) go through the interpreter too, which is slower but the same function. If
# something imported triton before this file, the kernel tests fail with opadvisor.kernels' own message
# saying so, rather than this file stopping the whole session.
if not torch.cuda.is_available():
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


@pytest.fixture(autouse=True)
def check_launch_keys(monkeypatch):
    """Every direct kernel launch (on a GPU) checks that its plan fixed everything Triton specialises on."""
    from opadvisor.kernels import _launch

    monkeypatch.setattr(_launch, "CHECK_KEYS", True, raising=False)


@pytest.fixture
def reference_path(monkeypatch):
    """The kernels' PyTorch reference for a test of a model patch (the patches' logic; each family tests
    the interpreter's Triton runs once). Triton picks interpreting or compiling when it is first imported:
    it is imported here while TRITON_INTERPRET=1 (above) holds, or a later interpreter test in this process
    would find it compiling."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
