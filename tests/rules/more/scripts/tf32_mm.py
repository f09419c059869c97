"""The same float32 MLP with TF32 enabled: its GEMMs run on tensor cores, fp32_gemm must stay silent."""

import torch
import torch.nn as nn

torch.backends.cuda.matmul.allow_tf32 = True
device = "cuda" if torch.cuda.is_available() else "cpu"
n, d, f = (2048, 1024, 4096) if device == "cuda" else (32, 32, 64)  # small on a CPU-only machine
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(n, d, device=device)
for _ in range(30):
    h = model(x)
    loss = (h @ h.T).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
