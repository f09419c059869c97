"""The distributed family: rules about DistributedDataParallel and FSDP2 (`fully_shard`) settings and
gradient synchronisation in multi-GPU training.

Each rule is a detect module (`<rule>.py`: its docs, ID, TITLE, FIX, `detect`) with its fix beside it
(`<rule>_fix.py`, the codemod, imported only by `opadvisor apply`). The family's typed facts are
`parallel_facts.py`, its profile helpers `_parallel.py`; its source helpers are `rewrite/_parallel.py`
(through `rewrite.toolkit`), shared with sparse_launch. See docs/ADDING_A_RULE.md.
"""
