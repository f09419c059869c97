"""The loss family: losses computed as several full-size passes where one fused kernel would do (cross
entropy over a wide vocabulary).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
