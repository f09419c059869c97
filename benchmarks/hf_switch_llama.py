"""A user's training script for issue 31's run-time attention switch (opadvisor/patching/ `hf_attn_switch`):
a transformers Llama (8 x 1024, seq 1024, batch 4, bf16 autocast on CUDA) built with its attention
implementation passed as a variable (`--attn`, "eager" by default), so `opadvisor apply` cannot write the
switch as a literal and inserts `opadvisor.patch(model, ...)`, which sets it at run time.

    cp benchmarks/hf_switch_llama.py /tmp/p/train.py && cd /tmp/p
    opadvisor profile train.py && opadvisor suggest && opadvisor apply --rule all && opadvisor verify
"""

import argparse

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

parser = argparse.ArgumentParser()
parser.add_argument("steps", type=int, nargs="?", default=12)
parser.add_argument("--attn", default="eager")
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
torch.manual_seed(0)
config = LlamaConfig(
    vocab_size=32000,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=8,
    num_attention_heads=16,
    num_key_value_heads=16,
    max_position_embeddings=1024,
)
model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
g = torch.Generator().manual_seed(1)
for step in range(args.steps):
    ids = torch.randint(0, 32000, (4, 1024), generator=g).to(device)
    with torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.6f}")
