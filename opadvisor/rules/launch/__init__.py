"""The launch family: steps whose GPU waits on the host (many short kernels bound by launch latency,
device-to-host synchronisations inside the step).

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, its facts, `detect`) with its fix
beside it where it has one (`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`; host_sync
is advice only). See docs/ADDING_A_RULE.md.
"""
