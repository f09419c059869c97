"""What opadvisor can do about code that lives in an installed library: the fixes, by module class.

Plain data, importable without torch: `suggest` reads it to say whether a finding in library code has a
fix, `apply` to write it, and `opadvisor.patching` (the runtime side) to know which modules it may
swap. Three kinds of fix:

- a *switch* the library already has, written by `opadvisor apply` into the user's code: HuggingFace's
  `attn_implementation="sdpa"` where the model is built or loaded (for any transformers model whose
  attention goes through transformers' attention interface and supports SDPA; where the script computes the
  value, `opadvisor.patch` sets the same switch per instance at run time: `hf_attn_switch`), timm's `set_fused_attn(True)` before
  the model is built, `need_weights=False` at a call of an `nn.MultiheadAttention` whose weights the
  caller drops;
- a *patch*: `opadvisor.patch(model)` swaps, per module instance, the forward of a recognised module for
  a fused equivalent (opadvisor.kernels and PyTorch), checked against the original on its first call;
  `opadvisor apply` inserts `model = opadvisor.patch(model, rules=[...])` after the line that built the
  model;
- the *rule*'s own fix where it does not depend on whose code launched the work: CUDA graphs over the
  whole model (`sparse_launch`) go into the user's script whatever library its modules come from.

Each fix names the module classes whose code holds the pattern (qualified: `transformers.models.bert.
modeling_bert.BertSelfAttention`; `timm.*`: every class of the package, each checked where the fix is
chosen), the rules whose findings it fixes, and its safety, as every fix does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Literal

__all__ = [
    "FIXES",
    "HF_ANY",
    "HF_ATTENTION_CLASSES",
    "LOADERS",
    "LibraryFix",
    "bert_family_classes",
    "deberta_v2_class",
    "llama_family_classes",
    "block_of",
    "fix_by_name",
    "fixes_for",
    "repeated_blocks",
]

# HuggingFace families whose attention and output blocks are BERT's, class for class (checked against the
# installed transformers by the patch at run time, and by tests/kernels/test_patch_hf.py): module name
# under transformers.models, module file, class-name prefix, and which of the blocks match.
_BERT_FAMILY: tuple[tuple[str, str, str, bool], ...] = (
    # (package, module, prefix, output blocks match too)
    ("bert", "modeling_bert", "Bert", True),
    ("roberta", "modeling_roberta", "Roberta", True),
    ("camembert", "modeling_camembert", "Camembert", True),
    ("xlm_roberta", "modeling_xlm_roberta", "XLMRoberta", True),
    ("electra", "modeling_electra", "Electra", True),
    ("data2vec", "modeling_data2vec_text", "Data2VecText", True),
    ("bert_generation", "modeling_bert_generation", "BertGeneration", True),
    ("roc_bert", "modeling_roc_bert", "RoCBert", True),
    ("ernie", "modeling_ernie", "Ernie", True),
    ("xlm_roberta_xl", "modeling_xlm_roberta_xl", "XLMRobertaXL", False),
    ("roberta_prelayernorm", "modeling_roberta_prelayernorm", "RobertaPreLayerNorm", False),
)


def bert_family_classes(block: Literal["SelfAttention", "SelfOutput", "Output"]) -> tuple[str, ...]:
    """Qualified names of the BERT-family classes of one block ("SelfOutput": the attention's output)."""
    out = []
    for package, module, prefix, outputs in _BERT_FAMILY:
        if block != "SelfAttention" and not outputs:
            continue
        out.append(f"transformers.models.{package}.{module}.{prefix}{block}")
    return tuple(out)


# HuggingFace families whose RMSNorm, MLP and causal-LM head are Llama's, statement for statement (checked
# against the installed transformers by the patch at run time and by tests/kernels/test_patch_llama.py):
# package under transformers.models, module file, class-name prefix, the classes that match.
_LLAMA_FAMILY: tuple[tuple[str, str, str, tuple[str, ...]], ...] = (
    # Llama's attention forward is its own (Mistral and Qwen2 pass a sliding window, Qwen3 normalises q and k)
    ("llama", "modeling_llama", "Llama", ("RMSNorm", "MLP", "ForCausalLM", "DecoderLayer", "Attention")),
    ("mistral", "modeling_mistral", "Mistral", ("RMSNorm", "MLP", "ForCausalLM", "DecoderLayer")),
    ("qwen2", "modeling_qwen2", "Qwen2", ("RMSNorm", "MLP", "ForCausalLM", "DecoderLayer")),
    ("qwen3", "modeling_qwen3", "Qwen3", ("RMSNorm", "MLP", "ForCausalLM", "DecoderLayer")),
    ("mixtral", "modeling_mixtral", "Mixtral", ("RMSNorm", "DecoderLayer")),
    ("qwen2_moe", "modeling_qwen2_moe", "Qwen2Moe", ("RMSNorm", "MLP", "DecoderLayer")),
    ("qwen3_moe", "modeling_qwen3_moe", "Qwen3Moe", ("RMSNorm", "MLP", "DecoderLayer")),
)


def llama_family_classes(
    block: Literal["RMSNorm", "MLP", "ForCausalLM", "DecoderLayer", "Attention"],
) -> tuple[str, ...]:
    """Qualified names of the Llama-family classes of one block (see _LLAMA_FAMILY)."""
    return tuple(
        f"transformers.models.{package}.{module}.{prefix}{block}"
        for package, module, prefix, blocks in _LLAMA_FAMILY
        if block in blocks
    )


# DeBERTa-v2/v3 (transformers.models.deberta_v2): its disentangled self-attention has its own patch; its
# output blocks (DebertaV2SelfOutput, DebertaV2Output) are BERT's, statement for statement, and its masked-LM
# forward computes BERT's loss (checked by the patch at run time and by tests/kernels/test_patch_deberta.py).
_DEBERTA_V2 = "transformers.models.deberta_v2.modeling_deberta_v2"


def deberta_v2_class(name: str) -> str:
    """The qualified name of one DeBERTa-v2 class ("DisentangledSelfAttention", "DebertaV2Output", ...)."""
    return f"{_DEBERTA_V2}.{name}"


HF_ATTENTION_CLASSES = (
    *bert_family_classes("SelfAttention"),
    "transformers.models.gpt2.modeling_gpt2.GPT2Attention",
)
# Any transformers class: transformers' attention switch (attn_implementation) serves every model whose
# attention dispatches through its attention interface (`eager_attention_forward` when it runs "eager") and
# whose class supports SDPA; rules/_library.py checks both for each finding.
HF_ANY = "transformers.*"
# transformers' class methods that build or load a model (the rest build it by calling the class)
LOADERS = ("from_pretrained", "from_config", "_from_config")
MHA = "torch.nn.modules.activation.MultiheadAttention"
TIMM = "timm.*"  # any timm class: the switch applies where the class's __init__ reads it (rules/_library.py)
ENCODER_LAYER = "torch.nn.modules.transformer.TransformerEncoderLayer"
LINEAR = "torch.nn.modules.linear.Linear"
ATTENTION_RULES = ("sdpa_attention", "fused_softmax")


@dataclass(frozen=True)
class LibraryFix:
    """One fix for library code (see the module docstring)."""

    name: str
    kind: Literal["patch", "switch", "rule"]
    classes: tuple[str, ...]  # module classes whose code holds the pattern ("*": any)
    rules: tuple[str, ...]  # rules whose findings it fixes
    safety: Literal["safe", "unsafe"]
    summary: str  # what it does, in words
    where: Literal["model", "call"] = "model"  # where apply writes it: after the model is built, at the call
    # chosen only by its own name (`opadvisor.patch(model, rules=["compile_blocks"])`), never by a rule's
    # name or by `rules=None`: it costs compile time at the first steps, so it is asked for, not implied
    opt_in: bool = False
    # block classes whose findings it also answers (`suggest` only; `patch` swaps `classes`): the pattern is
    # found in their forward (LlamaDecoderLayer's memory-bound ops) and runs in the modules it patches
    found_in: tuple[str, ...] = ()


FIXES: tuple[LibraryFix, ...] = (
    LibraryFix(
        "hf_attn_implementation",
        "switch",
        (*HF_ATTENTION_CLASSES, HF_ANY),
        ATTENTION_RULES,
        "safe",
        'attn_implementation="sdpa" where the model is built: transformers\' own fused attention '
        "(torch's scaled_dot_product_attention)",
    ),
    LibraryFix(
        "timm_fused_attn",
        "switch",
        (TIMM,),
        ATTENTION_RULES,
        "safe",
        "timm.layers.set_fused_attn(True) before the model is built: timm's own fused attention "
        "(torch's scaled_dot_product_attention), the same function",
    ),
    LibraryFix(
        "timm_fused_attn_experimental",
        "switch",
        (TIMM,),
        ATTENTION_RULES,
        "unsafe",
        "timm.layers.set_fused_attn(True, experimental=True) before the model is built: timm's fused "
        "attention for a module timm marks experimental (off by default; unsafe: timm does not vouch for it)",
    ),
    LibraryFix(
        "mha_need_weights",
        "switch",
        (MHA,),
        ATTENTION_RULES,
        "safe",
        "need_weights=False at the call: the caller drops the attention weights, and without them "
        "nn.MultiheadAttention runs scaled_dot_product_attention",
        where="call",
    ),
    LibraryFix(
        "hf_bert_self_attention",
        "patch",
        bert_family_classes("SelfAttention"),
        ATTENTION_RULES,
        "safe",
        "the eager attention (matmul, scale, + mask, softmax, dropout, matmul) as one "
        "scaled_dot_product_attention call",
    ),
    LibraryFix(
        "hf_bert_output",
        "patch",
        (
            *bert_family_classes("SelfOutput"),
            *bert_family_classes("Output"),
            deberta_v2_class("DebertaV2SelfOutput"),
            deberta_v2_class("DebertaV2Output"),
        ),
        ("fused_dropout_add",),
        "safe",
        "dense bias + dropout + residual add as one opadvisor.kernels.bias_dropout_add, then F.layer_norm",
    ),
    LibraryFix(
        "hf_deberta_attention",
        "patch",
        (deberta_v2_class("DisentangledSelfAttention"),),
        ATTENTION_RULES,
        "safe",
        "DeBERTa-v2/v3's disentangled attention: the relative-position scores (c2p and p2c gathers, scale, sum) "
        "as one opadvisor.kernels.disentangled_bias, then one scaled_dot_product_attention with them and the "
        "padding mask as its float mask (the [batch*heads, seq, seq] scores, mask, softmax and dropout never "
        "materialised by hand)",
    ),
    LibraryFix(
        "hf_deberta_positions",
        "patch",
        (deberta_v2_class("DebertaV2Encoder"),),
        ("sparse_launch", "host_sync"),
        "safe",
        "DeBERTa-v2/v3's relative-position buckets built once per sequence length and device, not at every "
        "forward (about twenty small ops, and with position_buckets a Python number copied to the GPU: a host "
        "synchronisation that also stops a CUDA-graph capture of the model)",
    ),
    LibraryFix(
        "hf_gpt2_attention",
        "patch",
        ("transformers.models.gpt2.modeling_gpt2.GPT2Attention",),
        ATTENTION_RULES,
        "safe",
        "GPT-2's eager attention as one causal scaled_dot_product_attention call",
    ),
    LibraryFix(
        "hf_attn_switch",
        "patch",
        (HF_ANY,),
        ATTENTION_RULES,
        "safe",
        "transformers' own switch to its SDPA attention (registered as opadvisor_sdpa: masks that skip "
        "themselves where no token is padded, under torch.compile and CUDA-graph capture too), set per model "
        'instance at run time by opadvisor.patch (for a model that ran "eager" or "sdpa"): checked against '
        "the attention it ran on the first call, undone by unpatch",
    ),
    LibraryFix(
        "hf_gelu_tanh",
        "patch",
        ("transformers.activations.NewGELUActivation",),
        ("fuse_region",),
        "safe",
        'the tanh GELU written op by op (GPT-2\'s MLP) as F.gelu(x, approximate="tanh"): one kernel',
    ),
    LibraryFix(
        "mha_weights_off",
        "patch",
        (MHA,),
        ATTENTION_RULES,
        "unsafe",
        "nn.MultiheadAttention called with need_weights=False (scaled_dot_product_attention inside); "
        "unsafe: the weights it returns become None",
    ),
    LibraryFix(
        "transformer_encoder_layer",
        "patch",
        (ENCODER_LAYER,),
        ("fused_dropout_add",),
        "safe",
        "nn.TransformerEncoderLayer's training path with each dropout + residual add (and the second "
        "linear's bias) as one opadvisor.kernels.bias_dropout_add",
    ),
    LibraryFix(
        "cuda_graphs",
        "rule",
        ("*",),
        ("sparse_launch",),
        "unsafe",
        "the model's forward and backward replayed from CUDA graphs (`model = cuda_graphed(model)` before its "
        "optimizer, in the script that calls it): the launches happen once per graph, whichever library wrote them",
        where="call",
    ),
    LibraryFix(
        "hf_mlm_loss",
        "patch",
        ("transformers.models.bert.modeling_bert.BertForMaskedLM", deberta_v2_class("DebertaV2ForMaskedLM")),
        ("fused_cross_entropy",),
        "safe",
        "the masked-LM loss over the vocabulary as opadvisor.kernels.cross_entropy (the model's forward "
        "runs with labels=None, then one pass over the 16-bit logits each way instead of eager's float32 "
        "copies; -100 labels ignored as before)",
    ),
    LibraryFix(
        "hf_mlm_linear_cross_entropy",
        "patch",
        ("transformers.models.bert.modeling_bert.BertForMaskedLM",),
        ("fused_cross_entropy",),
        "unsafe",
        "in training with labels, the masked-LM head's decoder (its matrix product and bias) and its loss as one "
        "opadvisor.kernels.linear_cross_entropy, chunked over tokens: the [tokens, vocabulary] logits are never "
        "held whole; unsafe: the output's logits are None then",
    ),
    LibraryFix(
        "hf_linear_cross_entropy",
        "patch",
        ("transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel", *llama_family_classes("ForCausalLM")),
        ("fused_cross_entropy",),
        "unsafe",
        "in training with labels, the LM head's matrix product and the causal-LM loss as one "
        "opadvisor.kernels.linear_cross_entropy, chunked over tokens: the [tokens, vocabulary] logits are never "
        "held whole, nor in float32; unsafe: the output's logits are None then (as Liger-Kernel's patch does)",
    ),
    LibraryFix(
        "hf_causal_lm_loss",
        "patch",
        ("transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel", *llama_family_classes("ForCausalLM")),
        ("fused_cross_entropy",),
        "safe",
        "the causal-LM loss (transformers' ForCausalLMLoss: labels shifted, -100 ignored) as "
        "opadvisor.kernels.cross_entropy over the 16-bit logits, without the float32 copy of them",
    ),
    LibraryFix(
        "hf_rms_norm",
        "patch",
        llama_family_classes("RMSNorm"),
        ("fuse_region",),
        "safe",
        "transformers' RMSNorm (Llama, Mistral, Qwen2/3, ...; float32 copy, square, mean, rsqrt, multiply, cast, "
        "weight: six kernels each way) as opadvisor.kernels.rms_norm, one Triton kernel each way",
        found_in=llama_family_classes("DecoderLayer"),
    ),
    LibraryFix(
        "hf_llama_rope",
        "patch",
        llama_family_classes("Attention"),
        ("fuse_region",),
        "safe",
        "Llama's attention with its rotary embedding of q and k (slices, negation, concatenation, two products "
        "and a sum each, in float32 under autocast) as opadvisor.kernels.rotary_embedding, one kernel each way; "
        "the attention itself as transformers runs it (its attn_implementation)",
        found_in=llama_family_classes("DecoderLayer"),
    ),
    LibraryFix(
        "hf_swiglu_mlp",
        "patch",
        llama_family_classes("MLP"),
        ("fuse_region",),
        "safe",
        "the SwiGLU MLP's act(gate(x)) * up(x) with SiLU as opadvisor.kernels.silu_mul, one kernel each way "
        "that saves gate and up only (not silu(gate) too)",
        found_in=llama_family_classes("DecoderLayer"),
    ),
    LibraryFix(
        "compile_blocks",
        "patch",
        ("*",),
        ("fuse_region", "fused_dropout_add", "manual_layernorm", "fused_softmax"),
        "safe",
        "the model's repeated library blocks (BertLayer x12, GPT2Block, timm's Block) each run one "
        "torch.compile'd forward, shared by all instances (regional compilation): inductor fuses the casts, "
        "dropout, residual adds, LayerNorm and activations between the matrix products; the same function up "
        "to rounding (dropout from inductor's random stream), the original where compiling fails",
        opt_in=True,
    ),
    LibraryFix(
        "padded_linear",
        "patch",
        (LINEAR,),
        ("gemm_align",),
        "safe",
        "an nn.Linear whose in/out features are not multiples of 8 computed on padded sizes "
        "(opadvisor.kernels.padded_linear; the same function, on CUDA)",
    ),
)


# torch.nn classes that are a model's repeated block (every other torch.nn class is an operator or a container)
TORCH_BLOCKS = (ENCODER_LAYER, "torch.nn.modules.transformer.TransformerDecoderLayer")


def repeated_blocks(modules: Mapping[str, str], library: Callable[[str], bool]) -> dict[str, str]:
    """The model's repeated library blocks, {module path: qualified class}, from its {path: class} map
    ("" the model itself): the instances of the outermost library class that holds modules of its own and
    has at least two instances in the model (transformers' BertLayer x12 under `encoder.layer`, GPT2Block,
    timm's Block, nn.TransformerEncoderLayer). `library(cls)` says whether a class is library code; of
    torch.nn only TORCH_BLOCKS count. Nothing inside a block is a block again."""
    count = Counter(modules.values())
    parents = {path.rpartition(".")[0] for path in modules if path}
    out: dict[str, str] = {}
    for path in sorted(modules, key=lambda p: (p.count(".") + bool(p), p)):
        cls = modules[path]
        if count[cls] < 2 or path not in parents or not path:
            continue
        if cls.startswith("torch.") and cls not in TORCH_BLOCKS or not library(cls):
            continue
        if any(path.startswith(block + ".") for block in out):
            continue
        out[path] = cls
    return out


def block_of(path: str | None, blocks: Mapping[str, str]) -> str | None:
    """The repeated block (a path of `blocks`) that module `path` is, or is inside; None when none."""
    if path is None:
        return None
    return next((b for b in blocks if path == b or path.startswith(b + ".")), None)


def fixes_for(module_class: str | None, rule: str) -> list[LibraryFix]:
    """The fixes for a finding of `rule` in the code of `module_class` (None: unknown), switches first."""
    found = [f for f in FIXES if _covers(f, module_class) and rule in f.rules]
    return sorted(found, key=lambda f: f.kind == "patch")


def _covers(fix: LibraryFix, module_class: str | None) -> bool:
    """Whether `fix` is for `module_class`: named, "*" (any), or "package.*" (any class of the package)."""
    for cls in (*fix.classes, *fix.found_in):
        if cls == "*" or cls == module_class:
            return True
        if cls.endswith(".*") and module_class is not None and module_class.startswith(cls[:-1]):
            return True
    return False


def fix_by_name(name: str) -> LibraryFix:
    for fix in FIXES:
        if fix.name == name:
            return fix
    raise KeyError(name)
