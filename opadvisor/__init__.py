"""opadvisor: find where a PyTorch training script loses GPU time, fix it, and prove the fix.

`opadvisor.patch(model)` / `opadvisor.unpatch(model)` (opadvisor/patching/) are imported on first
use: importing opadvisor does not import torch.
"""

from typing import Any

__version__ = "0.1.0"

_LAZY = {"patch": "patch", "unpatch": "unpatch", "patch_report": "patch_report"}


def step() -> None:
    """Mark the end of one training step, for loops that do not call a torch optimizer.

    Outside `opadvisor profile` this does nothing, so scripts can keep the call.
    """
    from opadvisor.profile import session

    session.mark_step()


def __getattr__(name: str) -> Any:
    """`opadvisor.patch`, `opadvisor.unpatch`, `opadvisor.patch_report`: opadvisor.patching's."""
    if name in _LAZY:
        import opadvisor.patching as _patch

        return getattr(_patch, _LAZY[name])
    raise AttributeError(f"module 'opadvisor' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
