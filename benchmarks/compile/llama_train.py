"""A transformers Llama compiled whole, as people train one (issue 33's real-code GPU row; benchmarks/
compile_gpt.py --model llama copies it as the user's train.py). No planted problem: what is left to find is
the compile itself. bf16 autocast, AdamW, random tokens; prints `step N loss L ms T`; `--tiny` for the CPU.
"""

import argparse
import time

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--tiny", action="store_true", help="a CPU-sized model")
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.tiny:
        sizes = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
        batch, seq, vocab = 2, 64, 512
    else:
        sizes = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12, num_attention_heads=16)
        batch, seq, vocab = 4, 1024, 32000
    config = LlamaConfig(vocab_size=vocab, num_key_value_heads=sizes["num_attention_heads"], **sizes)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).to(device)
    compiled = torch.compile(model, backend=args.backend)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    data = torch.randint(0, vocab, (batch, seq + 1), device=device)
    for step in range(args.steps):
        ids, labels = data[:, :seq], data[:, 1:]
        start = time.perf_counter()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = compiled(input_ids=ids).logits
        loss = F.cross_entropy(logits.float().reshape(-1, vocab), labels.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        print(f"step {step} loss {loss.item():.6f} ms {(time.perf_counter() - start) * 1000:.2f}")


if __name__ == "__main__":
    main()
