"""A DataLoader with default settings over a dataset whose __getitem__ takes ~1 ms: the GPU waits for
every batch, and the batch is copied from pageable memory (dataloader_stall must point at the loader)."""

import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset

device = "cuda" if torch.cuda.is_available() else "cpu"


class SlowDataset(Dataset):
    def __len__(self):
        return 4096

    def __getitem__(self, i):
        time.sleep(0.001)  # decoding / augmentation stand-in
        g = torch.Generator().manual_seed(i)
        return torch.randn(512, generator=g), torch.randint(0, 10, (), generator=g)


torch.manual_seed(0)
model = nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = DataLoader(SlowDataset(), batch_size=8, shuffle=True)  # expect: dataloader_stall
for x, y in loader:
    x, y = x.to(device), y.to(device)  # expect: batch copy
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
