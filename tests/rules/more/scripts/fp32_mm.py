"""A float32 MLP on the GPU with default settings: its GEMMs run in full float32, without TF32
(fp32_gemm must point at the `import torch` line, where the setting goes)."""

import torch  # expect: fp32_gemm
import torch.nn as nn

device = "cuda" if torch.cuda.is_available() else "cpu"
n, d, f = (2048, 1024, 4096) if device == "cuda" else (32, 32, 64)  # small on a CPU-only machine
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(d, f), nn.GELU(), nn.Linear(f, d)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(n, d, device=device)
for _ in range(30):
    h = model(x)  # expect: gemm site
    loss = (h @ h.T).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
