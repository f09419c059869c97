"""bf16 matrix products: an odd-width Linear head (a finding), an aligned one, and an odd one run in fp32 (none).

python bf16_gemm.py [--vocab 30522]      # --vocab 30528: everything aligned, nothing to report
"""

import argparse

import torch
import torch.nn as nn

parser = argparse.ArgumentParser()
parser.add_argument("--vocab", type=int, default=30522)
args = parser.parse_args()
torch.manual_seed(0)
device = "cuda" if torch.cuda.is_available() else "cpu"
width, rows = (4096, 4096) if device == "cuda" else (64, 16)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(width, width)  # aligned
        self.head = nn.Linear(width, args.vocab)  # expect: gemm_align
        self.side = nn.Linear(width, 1001)  # odd, but run in fp32 below

    def forward(self, x):
        h = self.inp(x)
        logits = self.head(h)
        side = self.side(x.float())
        return logits.float().logsumexp(-1).mean() + side.mean()


model = Model().to(device)
model.inp.to(torch.bfloat16)
model.head.to(torch.bfloat16)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
for _ in range(8):
    model(x).backward()
    opt.step()
    opt.zero_grad()
