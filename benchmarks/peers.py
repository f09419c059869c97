"""opadvisor beside its peers, side by side on one GPU (issue 31 item 4): one training step of a HuggingFace
model under each program, each program in a process of its own, the programs in alternating order per round.

    python benchmarks/peers.py --model llama --out /tmp/peers          # ~8-10 min on an H200
    python benchmarks/peers.py --model bert|gpt2|deberta --out /tmp/peers
    python benchmarks/peers.py --model bert --attn eager --out /tmp/peers   # issue 31's BERT row
    python benchmarks/peers.py --model llama --tiny --device cpu --out /tmp/peers   # smoke test, < 1 min

Programs (`--programs` picks some):
- eager:                   the model as built (transformers' default attention: SDPA; `--attn eager` builds it with
                           the hand-written attention, as a script passing `attn_implementation=args.attn` does);
- compile:                 torch.compile(model), the whole model;
- liger:                   Liger-Kernel's patch on the instance (`apply_liger_kernel_to_llama(model=model)`: RMSNorm,
                           SwiGLU, RoPE, fused linear cross-entropy); skipped with the reason where liger_kernel is
                           not importable or has no patch for the model (BERT, GPT-2, DeBERTa);
- opadvisor-safe:          opadvisor.patch(model) (the safe replacements);
- opadvisor-all:           opadvisor.patch(model, unsafe=True) (Llama: the LM head and loss fused, logits None);
- opadvisor-all+compile:   opadvisor.patch(model, unsafe=True), one eager step (the first-call checks), then
                           torch.compile(model);
- opadvisor-blocks:        (by name only) opadvisor.patch(model, rules=["compile_blocks", "fused_cross_entropy"],
                           unsafe=True): each decoder layer one torch.compile'd region (inductor fuses what the
                           kernels fuse), the fused LM head outside them: the kernels' alternative, side by side;
- opadvisor-all+graphs:    (by name only) opadvisor.patch(model, unsafe=True), one eager step (the first-call
                           checks), then `opadvisor.kernels.cuda_graphed(model)` (sparse_launch's unsafe fix):
                           forward and backward replayed from CUDA graphs, captured at the next step (needs
                           --warmup >= 2); the optimizer and the loss's .detach().clone() stay outside them;
- opadvisor-graphs:        (by name only) opadvisor.patch(model, unsafe=True), then `cuda_graphed(model)` at once:
                           what `opadvisor apply --rule all --unsafe` writes (captured at the first call, the
                           patches' first-call checks inside it);
- opadvisor-graphs+compile: (by name only) opadvisor.patch(model, unsafe=True), one eager step, then
                           `cuda_graphed(torch.compile(model))` (the order opadvisor.kernels.graphs documents).

DeBERTa (`--model deberta`, transformers' DebertaV2ForMaskedLM, which has no SDPA switch): opadvisor.patch
replaces the disentangled self-attention (hf_deberta_attention: disentangled_bias + one SDPA), builds the
encoder's relative positions once (hf_deberta_positions: without it every forward copies a Python number to the
GPU, which also stops a CUDA-graph capture), and patches the output blocks (hf_bert_output), the masked-LM loss
(hf_mlm_loss) and the 128100-wide decoder (padded_linear); each run's `notes` hold patch_report's lines, and
`dispatch` says which path each fused op took.

The step, as HuggingFace's training scripts run it (Trainer with bf16=True): float32 parameters, bf16
autocast, AdamW (opadvisor's programs: `opadvisor.kernels.AdamW(...)` on CUDA, as `opadvisor apply` rewrites
the plain construction of float32 CUDA parameters: the fused_optimizer finding's safe fix; `--optimizer
fused` for torch's fused=True), `model(input_ids=ids, labels=ids).loss.backward()`, use_cache=False, random token ids,
configurations built in code (nothing downloaded). Measured per program: step time (CUDA events around each
step after --warmup steps; the program's time is the median over its rounds of the median step), peak memory
(torch.cuda.max_memory_allocated over the timed steps), model FLOPs utilisation (6 x matmul parameters x
tokens + 12 x layers x hidden x sequence x tokens for attention, PaLM's count, over the H100/H200 dense
bf16 peak of 989 TFLOP/s), and the loss at every step of the first round (parity between programs).

Sizes: Llama 16 layers, hidden 2048, intermediate 8192, 32 heads (8 KV heads), vocabulary 128256 (Llama
3.2-1B's shape, untied head), sequence 2048, batch 4; BERT-base and DeBERTa-v3-base at sequence 512, batch 16
and 8; GPT-2 124M at 1024, batch 8. Results: <out>/peers_<model>.json (rewritten after every run, so a run
cut short keeps what finished) and a table on stdout. Time: every program's first round runs; a later
round's run starts only before --budget seconds (420), so one command stays within ten minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1
PEAK_FLOPS = 989e12  # H100 / H200 SXM dense bf16
PROGRAMS = ("eager", "compile", "liger", "opadvisor-safe", "opadvisor-all", "opadvisor-all+compile")
# asked for by name only: the regional alternative to the kernels (kernels or compiled blocks: measure and pick)
EXTRA_PROGRAMS = ("opadvisor-blocks", "opadvisor-graphs", "opadvisor-all+graphs", "opadvisor-graphs+compile")
# the programs whose first step runs eagerly (the patches' first-call checks), compiled or graphed after it
AFTER_FIRST_STEP = ("opadvisor-all+compile", "opadvisor-all+graphs", "opadvisor-graphs+compile")
COMPILE_BACKEND = "inductor"  # --compile-backend (the CPU smoke test: aot_eager, no C++ compiler needed)
LIGER_PATCHES = {"llama": "apply_liger_kernel_to_llama"}  # Liger-Kernel has none for BERT, GPT-2, DeBERTa

# (config class, model class, config kwargs, sequence, batch); tiny: (config kwargs, sequence, batch)
MODELS: dict[str, dict[str, Any]] = {
    "llama": {
        "classes": ("LlamaConfig", "LlamaForCausalLM"),
        "config": dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048, rope_theta=500000.0,
            tie_word_embeddings=False,
        ),
        "seq": 2048, "batch": 4,
        "tiny": dict(
            vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False,
        ),
    },
    "bert": {
        "classes": ("BertConfig", "BertForMaskedLM"), "config": {}, "seq": 512, "batch": 16,
        "tiny": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128),
    },
    "gpt2": {
        "classes": ("GPT2Config", "GPT2LMHeadModel"), "config": {}, "seq": 1024, "batch": 8,
        "tiny": dict(vocab_size=1000, n_embd=64, n_layer=2, n_head=2, n_positions=128),
    },
    "deberta": {
        "classes": ("DebertaV2Config", "DebertaV2ForMaskedLM"),
        "config": dict(  # microsoft/deberta-v3-base's configuration
            vocab_size=128100, hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
            intermediate_size=3072, max_position_embeddings=512, relative_attention=True, position_buckets=256,
            norm_rel_ebd="layer_norm", share_att_key=True, pos_att_type=["p2c", "c2p"], max_relative_positions=-1,
            position_biased_input=False, type_vocab_size=0,
        ),
        "seq": 512, "batch": 8,
        "tiny": dict(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=128, relative_attention=True, position_buckets=32, norm_rel_ebd="layer_norm",
                     share_att_key=True, pos_att_type=["p2c", "c2p"], position_biased_input=False),
    },
}  # fmt: skip


# ---- the child: one program, one process ----------------------------------------------------------------------
def build(model_name: str, tiny: bool, device: str, attn: str | None = None):
    import torch
    import transformers

    spec = MODELS[model_name]
    config_cls, model_cls = (getattr(transformers, name) for name in spec["classes"])
    torch.manual_seed(0)
    extra = (
        {"attn_implementation": attn} if attn else {}
    )  # as a script passes --attn eager to from_pretrained
    config = config_cls(**(spec["tiny"] if tiny else spec["config"]), **extra)
    config.use_cache = False  # training: no KV cache (as fine-tuning scripts set it)
    with torch.device(device):  # initialised where it trains: seconds, not a minute of CPU init at 1.5B
        model = model_cls(config)
    model.train()
    return model, config


def apply_program(model, program: str, model_name: str) -> tuple[Any, list[str]]:
    """(the model to train, what was done to it in words). Raises SkipProgram where the program does not
    apply (Liger-Kernel missing, or without a patch for this model)."""
    import torch

    notes: list[str] = []
    if program == "compile":
        return torch.compile(model, backend=COMPILE_BACKEND), notes
    if program == "liger":
        return _liger(model, model_name), [
            f"liger_kernel.transformers.{LIGER_PATCHES[model_name]}(model=model)"
        ]
    if program.startswith("opadvisor"):
        import opadvisor

        rules = ["compile_blocks", "fused_cross_entropy"] if program == "opadvisor-blocks" else None
        opadvisor.patch(model, rules=rules, unsafe=program != "opadvisor-safe", quiet=True)
        notes += opadvisor.patch_report(model).lines()
        if program == "opadvisor-graphs":
            from opadvisor.kernels import cuda_graphed

            model = cuda_graphed(model)
            notes.append("cuda_graphed(model)")
    return model, notes


def compile_after_first_step(model, program: str):
    """The model of an AFTER_FIRST_STEP program, after its first step ran eagerly (the patches' first-call
    checks): compiled, graphed, or both."""
    import torch
    from opadvisor.kernels import cuda_graphed

    if program == "opadvisor-all+compile":
        return torch.compile(model, backend=COMPILE_BACKEND)
    if program == "opadvisor-all+graphs":
        return cuda_graphed(model)  # captured at the next call

    return cuda_graphed(torch.compile(model, backend=COMPILE_BACKEND))


class SkipProgram(Exception):
    """The program does not apply here (its reason is the message)."""


def _liger(model, model_name: str):
    if model_name not in LIGER_PATCHES:
        raise SkipProgram(f"Liger-Kernel has no patch for {type(model).__name__}")
    try:
        import liger_kernel.transformers as liger
    except ImportError as exc:
        raise SkipProgram(f"liger_kernel is not importable ({exc})") from None
    getattr(liger, LIGER_PATCHES[model_name])(model=model)
    return model


def matmul_params(model) -> int:
    """Parameters that take part in a matrix product per token: the weights of nn.Linear and transformers'
    Conv1D modules, each shared weight once (a tied LM head counts; input embedding lookups do not)."""
    import torch.nn as nn

    seen = {}
    for module in model.modules():
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            seen[id(module.weight)] = module.weight.numel()
    return sum(seen.values())


def step_flops(model, config, batch: int, seq: int) -> float:
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    tokens = batch * seq
    return 6.0 * matmul_params(model) * tokens + 12.0 * layers * hidden * seq * tokens


def run_child(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    spec = MODELS[args.model]
    seq = args.seq or (64 if args.tiny else spec["seq"])
    batch = args.batch or (2 if args.tiny else spec["batch"])
    model, config = build(args.model, args.tiny, args.device, args.attn)
    result: dict[str, Any] = {"program": args.program, "seq": seq, "batch": batch}
    settings = apply_settings(args.set)
    try:
        model, notes = apply_program(model, args.program, args.model)
    except SkipProgram as exc:
        return {**result, "status": "skipped", "reason": str(exc)}
    notes = settings + notes
    # opadvisor's programs construct AdamW as `opadvisor apply` rewrites the script's plain AdamW(...) (the
    # fused_optimizer finding's safe fix); the others keep the script's optimizer as written
    ours = args.program.startswith("opadvisor")
    fused = ours and args.device.startswith("cuda") and args.optimizer == "fused"
    if fused:
        notes.append("AdamW(..., fused=True) (fused_optimizer)")
    if ours and args.optimizer == "opadvisor":
        from opadvisor.kernels import AdamW

        notes.append("opadvisor.kernels.AdamW (fused_optimizer)")
        optimizer = AdamW(model.parameters(), lr=1e-5)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused or None)
    result["notes"] = notes
    generator = torch.Generator().manual_seed(1)
    vocab = config.vocab_size
    batches = [torch.randint(0, vocab, (batch, seq), generator=generator).to(args.device) for _ in range(4)]
    cuda = args.device.startswith("cuda")

    def step(i: int) -> torch.Tensor:
        ids = batches[i % len(batches)]  # on the device already: no copy in the timed steps
        with torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach().clone()  # a CUDA graph's output is overwritten by its next replay

    losses = []
    compile_after_warmup = args.program in AFTER_FIRST_STEP
    if compile_after_warmup and args.warmup == 0:
        raise SystemExit(f"{args.program} needs --warmup >= 1 (its first step runs the checks eagerly)")
    for i in range(args.warmup):
        losses.append(step(i))
        if compile_after_warmup and i == 0:
            model = compile_after_first_step(model, args.program)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            losses.append(step(i))
            end.record()
            times.append((start, end))
        else:
            t0 = time.perf_counter()
            losses.append(step(i))
            times.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        step_ms = [s.elapsed_time(e) for s, e in times]
        peak = torch.cuda.max_memory_allocated() / 2**30
    else:
        step_ms = [t * 1e3 for t in times]
        peak = None
    median = statistics.median(step_ms)
    flops = step_flops(getattr(model, "_orig_mod", model), config, batch, seq)
    from opadvisor.kernels import dispatch_counts

    if args.kernels and cuda:  # after the timed steps: the profiler's overhead stays out of them
        result["kernels"] = kernel_breakdown(step, args.warmup + args.steps, args.kernels)
    return {
        **result,
        "status": "ok",
        "step_ms": step_ms,
        "median_ms": median,
        "peak_gib": peak,
        "tflops": flops / (median / 1e3) / 1e12,
        "mfu": flops / (median / 1e3) / PEAK_FLOPS,
        "losses": [float(v) for v in torch.stack(losses).float().cpu()],
        "dispatch": dispatch_counts(),
        **dynamo_graphs(),
    }


def dynamo_graphs() -> dict[str, Any]:
    """The graphs torch.compile made in this process and the graph breaks it met (dynamo's own counters; zero
    for a program that never compiles): a break splits the step into graphs with eager work between them."""
    from torch._dynamo.utils import counters

    breaks = counters.get("graph_break", {})
    return {
        "compiled_graphs": int(counters.get("stats", {}).get("unique_graphs", 0)),
        "graph_breaks": int(sum(breaks.values())),
        "graph_break_reasons": sorted(breaks, key=breaks.get, reverse=True)[:5],
    }


def kernel_breakdown(step, first: int, top: int, steps: int = 2) -> dict[str, Any]:
    """The GPU kernels of `steps` more steps under torch.profiler: per step, the device time of all kernels
    together (against the step's time: what the host leaves idle) and the `top` kernels by device time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(steps):
            step(first + i)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.self_device_time_total, reverse=True)
    busy = sum(e.self_device_time_total for e in kernels) / 1e3 / steps
    return {
        "device_busy_ms_per_step": busy,
        "kernels_per_step": sum(e.count for e in kernels) / steps,
        "top": [
            {
                "name": e.key[:140],
                "ms_per_step": e.self_device_time_total / 1e3 / steps,
                "count": e.count // steps,
            }
            for e in kernels[:top]
        ],
    }


# ---- the parent: rounds of child processes --------------------------------------------------------------------
def child_command(args: argparse.Namespace, program: str, out: Path) -> list[str]:
    command = [sys.executable, __file__, "--child", "--model", args.model, "--program", program, "--device",
               args.device, "--steps", str(args.steps), "--warmup", str(args.warmup), "--json-out", str(out),
               "--compile-backend", args.compile_backend, "--optimizer", args.optimizer]  # fmt: skip
    if args.tiny:
        command.append("--tiny")
    for flag in ("seq", "batch", "attn", "kernels"):
        if getattr(args, flag):
            command += [f"--{flag}", str(getattr(args, flag))]
    for setting in args.set:
        command += ["--set", setting]
    return command


def apply_settings(settings: list[str]) -> list[str]:
    """Set each "module.NAME=value" of opadvisor.kernels (a dispatch switch such as
    relpos.COMPILE_PATH=native) before the model is built; the notes that say so."""
    import importlib

    notes = []
    for setting in settings:
        target, _, value = setting.partition("=")
        module_name, _, name = target.rpartition(".")
        module = importlib.import_module(f"opadvisor.kernels.{module_name}")
        if not hasattr(module, name):
            raise SystemExit(f"--set {setting}: opadvisor.kernels.{module_name} has no {name}")
        old = getattr(module, name)
        setattr(module, name, type(old)(value) if not isinstance(old, bool) else value == "True")
        notes.append(f"opadvisor.kernels.{target} = {value!r} (was {old!r})")
    return notes


def run_program(args: argparse.Namespace, program: str, out_dir: Path, round_: int) -> dict[str, Any]:
    out = out_dir / f".{args.model}_{program}_{round_}.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    started = time.perf_counter()
    try:
        done = subprocess.run(child_command(args, program, out), capture_output=True, text=True,
                              timeout=args.timeout, env=env)  # fmt: skip
    except subprocess.TimeoutExpired:
        return {"program": program, "status": "failed", "reason": f"timed out after {args.timeout} s"}
    wall = time.perf_counter() - started
    if done.returncode != 0 or not out.exists():
        tail = (done.stderr or done.stdout)[-1500:]
        return {
            "program": program,
            "status": "failed",
            "reason": f"exit {done.returncode}: {tail}",
            "wall_s": wall,
        }
    result = json.loads(out.read_text())
    out.unlink()
    return {**result, "wall_s": wall, "warnings": warning_lines(done.stderr)}


def warning_lines(stderr: str, keep: int = 12) -> list[str]:
    """The child's warnings and opadvisor's own lines (a capture that fell back, a patch refused), so that a
    slow row can be explained from its JSON."""
    found = [ln.strip() for ln in stderr.splitlines() if "Warning" in ln or "opadvisor" in ln]
    return list(dict.fromkeys(found))[:keep]


# a round's entries that the program's summary keeps once (from its first round), not per round
SUMMARISED = ("losses", "notes", "dispatch", "warnings", "kernels", "graph_break_reasons")


def summarise(program: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return {"status": runs[-1].get("status", "failed"), "reason": runs[-1].get("reason"), "runs": runs}
    medians = [r["median_ms"] for r in ok]
    step_ms = statistics.median(medians)
    peaks = [r["peak_gib"] for r in ok if r["peak_gib"] is not None]
    return {
        "status": "ok",
        "step_ms": step_ms,
        "step_ms_per_round": medians,
        "peak_gib": max(peaks) if peaks else None,
        "mfu": statistics.median(r["mfu"] for r in ok),
        "tflops": statistics.median(r["tflops"] for r in ok),
        "losses": ok[0]["losses"],
        "notes": ok[0].get("notes", []),
        "dispatch": ok[0].get("dispatch", {}),
        "warnings": ok[0].get("warnings", []),
        "kernels": ok[0].get("kernels"),
        "compiled_graphs": ok[0].get("compiled_graphs", 0),
        "graph_breaks": ok[0].get("graph_breaks", 0),
        "graph_break_reasons": ok[0].get("graph_break_reasons", []),
        "runs": [{k: v for k, v in r.items() if k not in SUMMARISED} for r in runs],
    }


def parity(programs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Per program, the largest relative difference of its loss from eager's, step by step (first rounds)."""
    eager = programs.get("eager", {})
    if eager.get("status") != "ok":
        return {}
    out = {}
    for name, r in programs.items():
        if r.get("status") == "ok" and name != "eager":
            pairs = zip(r["losses"], eager["losses"], strict=False)
            out[name] = max((abs(a - b) / max(abs(b), 1e-12) for a, b in pairs), default=0.0)
    return out


def targets(programs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Issue 31's targets for Llama: opadvisor's safe fixes >= 1.1x Liger-Kernel's patch and >= torch.compile
    of the original, with peak memory no higher than Liger's (also reported for opadvisor-all)."""
    out: dict[str, Any] = {}
    for ours in ("opadvisor-safe", "opadvisor-all", "opadvisor-all+compile", "opadvisor-all+graphs"):
        mine = programs.get(ours, {})
        if mine.get("status") != "ok":
            continue
        entry: dict[str, Any] = {}
        for peer in ("eager", "compile", "liger"):
            other = programs.get(peer, {})
            if other.get("status") == "ok":
                entry[f"speedup_vs_{peer}"] = other["step_ms"] / mine["step_ms"]
        liger = programs.get("liger", {})
        if liger.get("status") == "ok" and liger.get("peak_gib") and mine.get("peak_gib"):
            entry["peak_vs_liger"] = mine["peak_gib"] / liger["peak_gib"]
        out[ours] = entry
    return out


def table(report: dict[str, Any]) -> str:
    rows = [f"{'program':24s} {'step ms':>9s} {'peak GiB':>9s} {'MFU':>6s} {'graphs/breaks':>13s}  loss[0..]"]
    for name, r in report["programs"].items():
        if r.get("status") != "ok":
            rows.append(f"{name:24s} {r.get('status')}: {str(r.get('reason'))[:150]}")
            continue
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "-"
        losses = " ".join(f"{v:.4f}" for v in r["losses"][:4])
        graphs = f"{r.get('compiled_graphs', 0)}/{r.get('graph_breaks', 0)}"
        rows.append(f"{name:24s} {r['step_ms']:9.2f} {peak:>9s} {r['mfu']:6.1%} {graphs:>13s}  {losses}")
    if report.get("loss_vs_eager"):
        diffs = ", ".join(f"{name} {diff:.2e}" for name, diff in report["loss_vs_eager"].items())
        rows.append(f"loss vs eager (max relative difference over the steps): {diffs}")
    for ours, entry in report["targets"].items():
        rows.append(f"{ours}: " + ", ".join(f"{k} {v:.3f}" for k, v in entry.items()))
    return "\n".join(rows)


def machine() -> dict[str, Any]:
    import torch
    import transformers

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    from importlib.metadata import PackageNotFoundError, version

    try:
        liger = version("liger-kernel")
    except PackageNotFoundError:
        liger = None
    return {"gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__, "liger_kernel": liger,
            "python": platform.python_version()}  # fmt: skip


def run_parent(args: argparse.Namespace) -> int:
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    programs = args.programs or list(PROGRAMS)
    unknown = [p for p in programs if p not in PROGRAMS + EXTRA_PROGRAMS]
    if unknown:
        known = ", ".join(PROGRAMS + EXTRA_PROGRAMS)
        print(f"peers.py: unknown program(s) {', '.join(unknown)}; known: {known}", file=sys.stderr)
        return 2
    results: dict[str, list[dict[str, Any]]] = {p: [] for p in programs}
    report: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION, "model": args.model, "tiny": args.tiny, "device": args.device,
        "steps": args.steps, "warmup": args.warmup, "rounds": args.rounds, "machine": machine(),
        "precision": "float32 parameters, bf16 autocast, AdamW", "peak_flops": PEAK_FLOPS,
        "compile_backend": args.compile_backend, "attn": args.attn,
    }  # fmt: skip
    path = out_dir / f"peers_{args.model}{'_' + args.tag if args.tag else ''}.json"
    started = time.perf_counter()
    for round_ in range(args.rounds):
        order = programs if round_ % 2 == 0 else programs[::-1]  # alternate: no program always first or last
        for program in order:
            if results[program] and results[program][-1].get("status") == "skipped":
                continue
            if results[program] and time.perf_counter() - started > args.budget:
                print(f"round {round_} {program}: not run (past --budget {args.budget} s)", flush=True)
                continue
            result = run_program(args, program, out_dir, round_)
            results[program].append(result)
            print(f"[{time.perf_counter() - started:6.0f} s] round {round_} {program}: {result.get('status')} "
                  f"{result.get('median_ms', result.get('reason', ''))}", flush=True)  # fmt: skip
            report["programs"] = {p: summarise(p, runs) for p, runs in results.items() if runs}
            report["targets"] = targets(report["programs"])
            report["loss_vs_eager"] = parity(report["programs"])
            path.write_text(json.dumps(report, indent=1))
    print(table(report))
    print(f"results: {path}")
    return 0


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="llama")
    parser.add_argument(
        "--programs",
        nargs="+",
        help=f"some of: {', '.join(PROGRAMS + EXTRA_PROGRAMS)} (default: {', '.join(PROGRAMS)})",
    )
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run (default 8; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; tiny 1)")
    parser.add_argument("--rounds", type=int, default=None, help="runs per program (default 2; tiny 1)")
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument(
        "--attn",
        default=None,
        help="the attention implementation the model is built with (eager, sdpa; default: transformers' own)",
    )
    parser.add_argument(
        "--kernels",
        type=int,
        default=0,
        help="after the timed steps, profile 2 more and keep the N costliest GPU kernels in the JSON (CUDA)",
    )
    parser.add_argument("--tiny", action="store_true", help="tiny configurations: a smoke test (CPU)")
    parser.add_argument("--timeout", type=int, default=420, help="seconds per run")
    parser.add_argument(
        "--budget",
        type=int,
        default=420,
        help="seconds after which no further round starts (first rounds always run)",
    )
    parser.add_argument("--tag", default="", help="a suffix of the results file (peers_<model>_<tag>.json)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="MODULE.NAME=VALUE",
        help="set a switch of opadvisor.kernels in every program's process (e.g. relpos.COMPILE_PATH=native)",
    )
    parser.add_argument(
        "--compile-backend", default=None, help="torch.compile's backend (inductor; tiny: aot_eager)"
    )
    parser.add_argument(
        "--optimizer",
        choices=("fused", "opadvisor"),
        default="opadvisor",
        help="the AdamW of opadvisor's programs: opadvisor.kernels.AdamW (what apply writes for float32 CUDA "
        "parameters; the default) or torch's fused=True",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "peers-out"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--program", help=argparse.SUPPRESS)
    parser.add_argument("--json-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.steps = args.steps if args.steps is not None else (3 if args.tiny else 8)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    args.rounds = args.rounds if args.rounds is not None else (1 if args.tiny else 2)
    args.compile_backend = args.compile_backend or ("aot_eager" if args.tiny else "inductor")
    return args


def main(argv: list[str] | None = None) -> int:
    global COMPILE_BACKEND
    args = parse(argv)
    COMPILE_BACKEND = args.compile_backend
    if args.child:
        result = run_child(args)
        Path(args.json_out).write_text(json.dumps(result))
        return 0
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
