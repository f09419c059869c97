import torch

model = torch.nn.Linear(4, 4)
print(model(torch.randn(2, 4)).sum().item())
