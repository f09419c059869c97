"""What autograd keeps for backward in one training step of a transformers model, per program (CPU, no GPU):

    TRITON_INTERPRET=1 PYTHONPATH=.:tests/cpu_torchvision python benchmarks/saved_bytes.py --program eager
    ... --program opadvisor-safe | opadvisor-all [--model llama] [--tokens 256] [--batch 2]

A LlamaForCausalLM from a config (2 layers, hidden 256, vocabulary 16032: Llama-3.2-1B's vocabulary-to-width
ratio) under CPU bf16 autocast; the bytes of every tensor saved for backward (each storage once, through
`torch.autograd.graph.saved_tensors_hooks`; not the parameters themselves, which are kept anyway, but their
copies) in the second step (the first runs opadvisor's first-call checks),
the largest groups by dtype and shape, and the loss. Saved bytes are what a step's activation memory is made of;
they do not depend on the device (the kernels run through Triton's interpreter), so they are measured here,
where GPU peak memory cannot be.
"""

from __future__ import annotations

import argparse
import collections

import torch
import transformers


def build(program: str) -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=16032, hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, tie_word_embeddings=False,
    )  # fmt: skip
    config.use_cache = False
    model = transformers.LlamaForCausalLM(config).train()
    if program.startswith("opadvisor"):
        import opadvisor

        opadvisor.patch(model, unsafe=program != "opadvisor-safe", quiet=True)
    return model


def step(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, dict[tuple[str, tuple], int]]:
    saved: dict[int, tuple[str, tuple, int]] = {}
    # the parameters are kept anyway: a saved parameter (not a copy of one) costs no activation memory
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ptr = t.untyped_storage().data_ptr()
        if ptr not in parameters:
            saved[ptr] = (str(t.dtype), tuple(t.shape), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(input_ids=x, labels=x)
    out.loss.backward()
    model.zero_grad(set_to_none=True)
    groups: dict[tuple[str, tuple], int] = collections.Counter()
    for dtype, shape, nbytes in saved.values():
        groups[(dtype, shape)] += nbytes
    return out.loss.item(), groups


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--program", choices=["eager", "opadvisor-safe", "opadvisor-all"], default="eager")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument("--batch", type=int, default=2)
    ns = parser.parse_args()
    model = build(ns.program)
    x = torch.randint(0, 16032, (ns.batch, ns.tokens), generator=torch.Generator().manual_seed(1))
    step(model, x)  # opadvisor's first-call checks run here
    loss, groups = step(model, x)
    total = sum(groups.values())
    print(f"{ns.program}: loss {loss:.5f}, saved for backward {total / 2**20:.2f} MiB")
    for (dtype, shape), nbytes in sorted(groups.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {dtype} {list(shape)}: {nbytes / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
