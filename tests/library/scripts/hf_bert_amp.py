"""A tiny transformers BERT trained under bf16 autocast, as BERT is trained on a GPU (here on the CPU): the
model's code lives in the library, its 2 BertLayer blocks are repeated (built from a config: nothing is
downloaded)."""

import sys

import torch
from transformers import BertConfig, BertForMaskedLM

steps = int(sys.argv[1]) if len(sys.argv) > 1 else 6
torch.manual_seed(0)
config = BertConfig(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)
model = BertForMaskedLM(config)  # expect: model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 101, (2, 16))
for step in range(steps):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)  # expect: call
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.6f}")
