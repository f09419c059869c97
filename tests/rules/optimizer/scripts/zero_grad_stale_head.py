"""`model.zero_grad(False)` where a head is used only in the first step: from then on its gradients are
zeroed every step but get no new one. With set_to_none they would be None and AdamW would stop stepping
the head (momentum and weight decay no longer move it): the fix is unsafe here."""

import torch


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(32, 32)
        self.head = torch.nn.Linear(32, 3)  # shapes no other parameter has

    def forward(self, x: torch.Tensor, first: bool) -> torch.Tensor:
        y = self.body(x)
        return y.sum() + (self.head(y).sum() if first else 0.0)


torch.manual_seed(0)
model = Net()
opt = torch.optim.AdamW(model.parameters())
x = torch.randn(16, 32)
for step in range(8):
    model.zero_grad(False)  # expect: zero_grad_set_to_none
    model(x, first=step == 0).backward()
    opt.step()
