"""A tiny transformers BERT trained the way people train it: the model's code lives in the library.

Eager attention (so the attention is matmul -> scale -> + mask -> softmax -> dropout -> matmul, op by op,
in transformers' modeling_bert.py), built from a config object: nothing is downloaded.
"""

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
    attn_implementation="eager",
)
model = BertForMaskedLM(config)  # expect: model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 101, (2, 16))
mask = torch.ones(2, 16, dtype=torch.long)
mask[1, 12:] = 0
for step in range(steps):
    out = model(input_ids=ids, attention_mask=mask, labels=ids)  # expect: call
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.6f}")
