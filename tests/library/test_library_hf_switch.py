"""transformers' attention switch for models opadvisor has no attention patch of its own for (Llama, and the
families that share its attention interface): where the script builds the model with a computed
`attn_implementation` (`args.attn`) that ran "eager", `apply` cannot write the literal, so it inserts
`opadvisor.patch(model, rules=[...])`, which sets the switch per instance at run time, checked on the first
call; the losses are kept."""

from __future__ import annotations

from pathlib import Path

from library_testlib import assert_verify_parity, line_of, run_opadvisor

from opadvisor.profile.runs import load_run
from opadvisor.rules._library import computed_attn_argument
from opadvisor.rules.engine import analyse


def _findings(project: Path):
    _, profiles = load_run(str(next((project / ".opadvisor" / "runs").iterdir())))
    return {f.rule: f for f in analyse(profiles).findings}


def test_a_computed_attn_implementation_is_fixed_by_the_run_time_switch(library_run) -> None:
    project = library_run("hf_llama")
    found = _findings(project)
    for rule in ("sdpa_attention", "fused_softmax"):
        f = found[rule]
        assert f.function.endswith("eager_attention_forward") and "llama" in f.path
        assert f.library["fix"]["name"] == "hf_attn_switch" and f.library["fix"]["kind"] == "patch"
        assert f.fix == "safe" and "opadvisor.patch" in f.advice
    model = f.library["model"]
    assert model["attn_implementation"] == "eager"
    assert model["line"] == line_of(project / "hf_llama.py", "model")


def test_apply_inserts_the_patch_and_the_losses_are_kept(project_copy, tmp_path: Path) -> None:
    project = project_copy("hf_llama", tmp_path / "p")
    script = project / "hf_llama.py"
    run_opadvisor(project, "apply", "--rule", "sdpa_attention")
    lines = script.read_text().splitlines()
    model_line = line_of(script, "model")
    assert lines[model_line] == 'model = opadvisor.patch(model, rules=["sdpa_attention"])'
    text = script.read_text()
    again = run_opadvisor(project, "apply", "--rule", "sdpa_attention")
    assert script.read_text() == text and "nothing to rewrite" in again.stdout + again.stderr
    assert_verify_parity(project)


def test_a_literal_eager_gets_the_literal_switch(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(
        "from transformers import AutoModelForCausalLM\n"
        'model = AutoModelForCausalLM.from_config(config, attn_implementation="eager")\n'
        "model = AutoModelForCausalLM.from_config(config, attn_implementation=args.attn)\n"
        "model = AutoModelForCausalLM.from_pretrained(name, **options)\n"
        "model = Model(config, **options)\n"
    )
    assert computed_attn_argument(str(script), 2) is None
    assert computed_attn_argument(str(script), 3) == "args.attn"
    assert computed_attn_argument(str(script), 4) == "**options"  # a loader's kwargs may carry it
    assert computed_attn_argument(str(script), 5) is None  # a constructor's go to the model, not the switch
