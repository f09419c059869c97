"""The compile family: rules about torch.compile (graph breaks, recompilations, compiling the repeated
block instead of the whole model).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`); their facts are in
`opadvisor/rules/compile_facts.py`, which distributed's fsdp_root_only reads too. See docs/ADDING_A_RULE.md.
"""
