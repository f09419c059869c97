"""A rewritten script on a CPU-only machine needs neither numpy nor Triton's interpreter: the kernels take
their PyTorch reference path. Asked for the interpreter (TRITON_INTERPRET=1) without numpy, one line says
what to install. Each case runs in a fresh process where `import numpy` fails."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BLOCK_NUMPY = """
import sys

class _NoNumpy:
    def find_spec(self, name, path=None, target=None):
        if name == "numpy" or name.startswith("numpy."):
            raise ModuleNotFoundError("No module named 'numpy'", name="numpy")
        return None

sys.meta_path.insert(0, _NoNumpy())
import warnings
warnings.filterwarnings("ignore", message="Failed to initialize NumPy")  # torch's own warning
"""

USE_KERNELS = """
import torch
from opadvisor.kernels import bias_dropout_add, cross_entropy, masked_softmax

x = torch.randn(2, 4, 8, 8, requires_grad=True)
mask = torch.rand(2, 1, 1, 8) > 0.2
masked_softmax(x, mask, scale=0.5, dropout_p=0.1).sum().backward()
h = torch.randn(4, 16, requires_grad=True)
bias_dropout_add(h, torch.zeros(16), torch.randn(4, 16), 0.1).sum().backward()
cross_entropy(torch.randn(4, 10, requires_grad=True), torch.tensor([1, 2, 3, 4])).backward()
assert "triton" not in sys.modules and "numpy" not in sys.modules, "the reference path imported them"
print("reference ok")
"""


def run(code: str, interpret: bool) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # conftest sets it here
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run(
        [sys.executable, "-c", BLOCK_NUMPY + code], env=env, capture_output=True, text=True, timeout=120
    )


def test_cpu_reference_path_needs_no_numpy_and_no_triton() -> None:
    proc = run(USE_KERNELS, interpret=False)
    assert proc.returncode == 0, proc.stderr
    assert "reference ok" in proc.stdout


@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="Triton is not installed"
)
def test_interpreter_without_numpy_says_what_to_install() -> None:
    proc = run(USE_KERNELS, interpret=True)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert "needs numpy: pip install numpy" in last, proc.stderr
    assert f"{os.sep}triton{os.sep}" not in proc.stderr, proc.stderr  # said before triton's import failed
