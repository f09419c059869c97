"""The optimizer family: rules about how the optimizer and its gradients are handled each step.

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`, its facts) with its fix
beside it (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`); see docs/ADDING_A_RULE.md.
"""
