"""Lets `import torchvision` work on a CPU-only torch, in the test suite's processes.

PyPI has no CPU build of torchvision: its wheel's operator library links against CUDA torch, fails to load
on the CPU build, and torchvision then fails at import registering fake kernels for operators that were
never defined. On such a machine (this one, CI) this defines those operators' names, so torchvision
imports; nothing here ever calls them (a ViT uses none of torchvision's detection operators). Where the
library loads (a CUDA machine), this does nothing. torchvision comes with timm (which .ci/run installs
for the timm tests), and lightning and transformers' Trainer import it whenever it is installed, so
tests/conftest.py runs this in the test process and puts this folder on PYTHONPATH for every process the
tests start (`opadvisor profile`, the scripts, verify's children); never in a user's run.
"""

import importlib.abc
import importlib.util
import sys

_OPS = (
    "nms",
    "qnms",
    "roi_align",
    "_roi_align_backward",
    "roi_pool",
    "_roi_pool_backward",
    "ps_roi_align",
    "_ps_roi_align_backward",
    "ps_roi_pool",
    "_ps_roi_pool_backward",
    "deform_conv2d",
    "_deform_conv2d_backward",
)
_LIBRARIES = []  # keeps the definitions alive


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name != "torchvision":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec("torchvision")
        if spec is None or spec.origin is None:
            return None
        import glob
        import os

        import torch

        found = glob.glob(os.path.join(os.path.dirname(spec.origin), "_C*.so"))
        try:
            torch.ops.load_library(found[0])
            return None  # the real operators: nothing to do
        except (OSError, IndexError):
            pass
        library = torch.library.Library("torchvision", "DEF")
        for op in _OPS:
            library.define(f"{op}(Tensor x) -> Tensor")
        _LIBRARIES.append(library)
        return None


# once per process: a worker started with this on PYTHONPATH also runs it from tests/conftest.py
if not getattr(sys, "_opadvisor_cpu_torchvision", False):
    sys._opadvisor_cpu_torchvision = True
    sys.meta_path.insert(0, _BeforeTorchvision())
