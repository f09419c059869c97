"""Never steps an optimizer and never calls opadvisor.step(): profiled as a time window."""

import time

import torch

model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
deadline = time.monotonic() + 4.0
with torch.no_grad():
    while time.monotonic() < deadline:
        model(torch.randn(4, 16))
        time.sleep(0.01)
