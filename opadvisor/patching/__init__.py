"""Model patching: `opadvisor.patch(model)` replaces the forwards of library modules (BERT family, GPT-2,
torch.nn attention/encoder layers and Linear, LM-head losses, the Llama family, DeBERTa-v2, compiled blocks)
with ones that call opadvisor.kernels' fused ops; `unpatch` restores them, `patch_report` says what ran.

The kernels stay in opadvisor.kernels; this package is what applies them to models.
"""

from .core import PatchReport, patch, patch_report, unpatch

__all__ = ["PatchReport", "patch", "patch_report", "unpatch"]
