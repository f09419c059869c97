"""Puts its own src/ folder on sys.path at run time, then imports the model from it (a common layout)."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mymodel.model import Encoder  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--dropout", type=float, default=0.1)
args = parser.parse_args()

torch.manual_seed(0)
model = Encoder(dropout=args.dropout)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
data = torch.Generator().manual_seed(0)
for step in range(1, args.steps + 1):
    ids = torch.randint(0, 100, (4, 16), generator=data)
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    logits = model(ids, mask)
    loss = F.cross_entropy(logits.view(-1, 100), ids.view(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.6f}")
