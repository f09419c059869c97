"""Changes into src/ and imports the model from the current folder ('' first on sys.path)."""

import os
import sys

os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "src"))
sys.path.insert(0, "")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from mymodel.model import Encoder  # noqa: E402

torch.manual_seed(0)
model = Encoder()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for _ in range(1, 7):
    ids = torch.randint(0, 100, (4, 16))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:, 12:] = 0
    loss = F.cross_entropy(model(ids, mask).view(-1, 100), ids.view(-1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
