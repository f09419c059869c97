"""Batches prepared by worker processes into pinned memory, copied asynchronously, while the GPU is busy
with a large model: the next batch is ready long before it is needed, so dataloader_stall stays silent."""

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset


class Batches(Dataset):
    """Whole batches (the DataLoader's automatic batching is off): a worker only slices."""

    def __init__(self, n_batches, batch, features):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n_batches, batch, features, generator=g)
        self.y = torch.randint(0, 10, (n_batches, batch), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    batch, width = (4096, 8192) if device == "cuda" else (16, 32)  # small on a CPU-only machine
    torch.manual_seed(0)
    loader = DataLoader(Batches(16, batch, 256), batch_size=None, shuffle=True, num_workers=2,
                        pin_memory=device == "cuda", persistent_workers=True)
    layers = [nn.Linear(256, width), nn.ReLU()]
    for _ in range(4):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(4):
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)


if __name__ == "__main__":
    main()
