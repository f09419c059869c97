"""`OpadvisorCallback`: opadvisor's window inside a HuggingFace `transformers.Trainer` run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from opadvisor.profile.recorder import WindowRecorder

__all__ = ["OpadvisorCallback"]


class OpadvisorCallback(TrainerCallback):
    """Record `steps` Trainer steps after `warmup` into an opadvisor run folder.

    Steps are the Trainer's own (`on_step_end`: one per optimizer step, so gradient accumulation counts
    once). Hooks go in when the Trainer is built (`on_init_end`; `on_train_begin` for a callback added
    later), so the optimizer and DataLoader the Trainer builds are recorded where they are built. After
    the window the run is written and training goes on, or stops with `stop_after_window=True`.
    Under `opadvisor profile` or `opadvisor verify` the callback does nothing (they record the run).
    """

    def __init__(
        self, warmup: int = 3, steps: int = 5, out: str | Path | None = None, stop_after_window: bool = False
    ):
        self.recorder = WindowRecorder(warmup=warmup, steps=steps, out=out)
        self.stop_after_window = stop_after_window

    @property
    def run_dir(self) -> Path | None:
        """The run folder, once written."""
        outcome = self.recorder.outcome
        return outcome.run_dir if outcome is not None else None

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.start()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.start()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.recorder.step() and self.stop_after_window:
            control.should_training_stop = True

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.recorder.stop()
