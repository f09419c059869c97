import torch

model = torch.nn.Linear(4, 4)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(10):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    if i == 1:
        raise ValueError("the user's own bug in step 3")
