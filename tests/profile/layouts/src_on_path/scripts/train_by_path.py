"""Loads the model from a sibling folder by its (relative) path with importlib, not through sys.path, then
changes into an output folder."""

import importlib.util
import os

import torch
import torch.nn.functional as F

spec = importlib.util.spec_from_file_location(
    "model", os.path.join(os.path.dirname(__file__), "..", "src", "mymodel", "model.py")
)
model_module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(model_module)
os.makedirs(os.path.join(os.path.dirname(__file__), "..", "out"), exist_ok=True)
os.chdir(os.path.join(os.path.dirname(__file__), "..", "out"))  # where checkpoints would go

torch.manual_seed(0)
model = model_module.Encoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(1, 7):
    ids = torch.randint(0, 100, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    loss = F.cross_entropy(model(ids, mask).view(-1, 100), ids.view(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
