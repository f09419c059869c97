"""The hand-written attention model of trainer_custom.py, trained by Lightning with opadvisor's callback."""

import sys

import lightning.pytorch as pl
import torch
from trainer_custom import TinyEncoder, Tokens

from opadvisor.integrations import OpadvisorLightningCallback


class Module(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.model = TinyEncoder()

    def training_step(self, batch, batch_idx):
        return self.model(**batch)["loss"]

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main(steps=6, warmup=1, record=2, accumulate=1):
    torch.manual_seed(0)
    loader = torch.utils.data.DataLoader(Tokens(steps * 4 * accumulate), batch_size=4)
    trainer = pl.Trainer(
        max_steps=steps,
        accelerator="cpu",
        devices=1,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[OpadvisorLightningCallback(warmup=warmup, steps=record)],
    )
    trainer.fit(Module(), loader)
    print(f"global steps {trainer.global_step}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:5]))
