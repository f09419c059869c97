"""The training loop every corpus model shares: synthetic tokens, a language-model loss, AdamW, N steps."""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F


def train(
    model: torch.nn.Module, vocab: int, seq: int, batch: int = 4, lm_head: torch.nn.Module | None = None
):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.manual_seed(0)
    params = list(model.parameters()) + (list(lm_head.parameters()) if lm_head is not None else [])
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    model.train()
    for step in range(1, args.steps + 1):
        ids = torch.randint(0, vocab, (batch, seq))
        hidden = model(ids)
        logits = lm_head(hidden) if lm_head is not None else hidden
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print(f"step {step} loss {loss.item():.6f}")
