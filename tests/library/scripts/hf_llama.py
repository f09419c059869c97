"""A tiny transformers Llama trained the way people train it, its attention implementation chosen on the
command line (`--attn`, "eager" by default) and passed as a variable where the model is built: `apply`
cannot write the switch as a literal there, so the fix is transformers' switch set by opadvisor.patch at
run time. Built from a config object: nothing is downloaded.
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int, nargs="?", default=6)
parser.add_argument("--attn", default="eager")
args = parser.parse_args()
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=101,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=64,
    max_position_embeddings=32,
)
model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)  # expect: model
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ids = torch.randint(0, 101, (2, 16))
for step in range(args.steps):
    out = model(input_ids=ids, labels=ids)  # expect: call
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {out.loss.item():.6f}")
