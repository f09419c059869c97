"""AdamW with fused=True on CUDA (plain AdamW on a CPU-only machine): fused_optimizer must stay silent."""

import torch
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
model = nn.Sequential(*[nn.Linear(128, 128) for _ in range(24 if device == "cuda" else 4)]).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=device == "cuda")
x = torch.randn(32, 128, device=device)
for _ in range(30):
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
