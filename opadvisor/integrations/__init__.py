"""Record opadvisor's window inside a training framework's own loop, through its callbacks.

    from opadvisor.integrations import OpadvisorCallback           # transformers.Trainer
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OpadvisorCallback()])

    from opadvisor.integrations import OpadvisorLightningCallback  # lightning.pytorch.Trainer
    trainer = L.Trainer(max_steps=100, callbacks=[OpadvisorLightningCallback()])

Each records, like `opadvisor profile`, `steps` training steps after `warmup` (the framework's own step
events: one per optimizer step) into `.opadvisor/runs/<id>/` (or `out`), so `opadvisor suggest`, `apply`,
`verify`, `report` and `diff` read it. Training goes on after the window unless `stop_after_window`.
The framework is imported only when its callback is: `import opadvisor` never imports transformers or
lightning.
"""

from __future__ import annotations

from typing import Any

__all__ = ["OpadvisorCallback", "OpadvisorLightningCallback"]

_WHERE = {
    "OpadvisorCallback": "opadvisor.integrations.hf_trainer",
    "OpadvisorLightningCallback": "opadvisor.integrations.lightning_trainer",
}


def __getattr__(name: str) -> Any:
    # the callbacks subclass their framework's base class: import it only when one is asked for
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
