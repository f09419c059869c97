"""`OpadvisorLightningCallback`: opadvisor's window inside a Lightning `Trainer.fit` run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

try:
    from lightning.pytorch import Callback
except ImportError:  # the older package name
    from pytorch_lightning import Callback

from opadvisor.profile.recorder import WindowRecorder

__all__ = ["OpadvisorLightningCallback"]


class OpadvisorLightningCallback(Callback):
    """Record `steps` training steps after `warmup` into an opadvisor run folder.

    A step ends when the Trainer's `global_step` (its optimizer steps) moves on at the end of a batch, so
    `accumulate_grad_batches` counts once per optimizer step. Hooks go in at `setup` for fitting, before
    the Trainer builds the optimizers. After the window the run is written and training goes on, or stops
    with `stop_after_window=True`. Under `opadvisor profile` or `opadvisor verify` it does nothing.
    """

    def __init__(
        self, warmup: int = 3, steps: int = 5, out: str | Path | None = None, stop_after_window: bool = False
    ):
        self.recorder = WindowRecorder(warmup=warmup, steps=steps, out=out)
        self.stop_after_window = stop_after_window
        self._global_step: int | None = None

    @property
    def run_dir(self) -> Path | None:
        """The run folder, once written."""
        outcome = self.recorder.outcome
        return outcome.run_dir if outcome is not None else None

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.recorder.start()

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.start()
        self._global_step = trainer.global_step

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if trainer.global_step == self._global_step:
            return  # an accumulation micro-batch: no optimizer step yet
        self._global_step = trainer.global_step
        if self.recorder.step() and self.stop_after_window:
            trainer.should_stop = True

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        self.recorder.stop()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit":
            self.recorder.stop()
