"""The data family: steps that wait for their input (the GPU idle while the DataLoader produces the next
batch, host-to-device copies that block).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). See docs/ADDING_A_RULE.md.
"""
