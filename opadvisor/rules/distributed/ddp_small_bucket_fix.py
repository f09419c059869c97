"""Codemod for `ddp_small_bucket`: a DistributedDataParallel call's small `bucket_cap_mb` set to 25.

Profile mode only. Each target is the statement that built the DDP wrapper; a literal `bucket_cap_mb=`
below the rule's threshold gets DDP's default, 25 (the finding's `bucket_cap_mb_fix`):

    model = DDP(model, bucket_cap_mb=1)  ->  model = DDP(model, bucket_cap_mb=25)

Refused (left alone, with the reason): a value that is not a number literal (`bucket_cap_mb=args.bucket`:
change it where it is set), a call with `**kwargs` and no `bucket_cap_mb=`.

Fix safety: safe (the same gradient sums, sent in fewer messages).
"""

from __future__ import annotations

from typing import ClassVar

import libcst as cst
from libcst.metadata import PositionProvider, QualifiedNameProvider

from opadvisor.rewrite.base import RuleCodemod, Target, target_facts
from opadvisor.rewrite.toolkit import code, keyword, number_value, replace_keyword_value, targeted_ddp_call
from opadvisor.rules.distributed.parallel_facts import DdpFacts

KEYWORD = "bucket_cap_mb"
SMALL_MB = 4.0  # the rule's threshold (ddp_small_bucket.py SMALL_BUCKET_MB)


class DdpSmallBucketCodemod(RuleCodemod):
    """A small literal `bucket_cap_mb=` of the targeted DDP(...) calls set to the finding's size."""

    RULE: ClassVar[str] = "ddp_small_bucket"
    FACTS = DdpFacts
    SAFETY: ClassVar[str] = "safe"
    STATIC_MODE: ClassVar[bool] = False
    COMPOSES: ClassVar[bool] = True  # ddp_find_unused edits the same call
    NO_KERNEL_OP: ClassVar[str] = "a DDP setting, not an op"
    METADATA_DEPENDENCIES: ClassVar[tuple] = (PositionProvider, QualifiedNameProvider)

    def leave_Call(self, original_node: cst.Call, updated_node: cst.Call) -> cst.BaseExpression:
        target = targeted_ddp_call(self, original_node)
        if target is None:
            return updated_node
        arg = keyword(original_node, KEYWORD)
        if arg is None:
            self.skip(original_node, f"no {KEYWORD}= in the call: set it where the DDP arguments come from")
            return updated_node
        value = number_value(arg.value)
        if value is None:
            self.skip(original_node, f"{KEYWORD}={code(arg.value)} is no number: change it where it is set")
            return updated_node
        if value >= SMALL_MB:
            self.already = f"{KEYWORD}={code(arg.value)} is not small"
            return updated_node
        size = _fix_size(target)
        self.record_change(original_node, f"{KEYWORD}={code(arg.value)} -> {size}: fewer, larger all-reduces")
        return replace_keyword_value(updated_node, KEYWORD, cst.Integer(str(size)))

    def leave_Module(self, original_node: cst.Module, updated_node: cst.Module) -> cst.Module:
        self.note_unreached(lambda t: "no DistributedDataParallel(...) call on these lines")
        return updated_node


def _fix_size(target: Target) -> int:
    facts = target_facts(target, DdpFacts)
    return facts.bucket_cap_mb_fix if facts is not None else DdpFacts.bucket_cap_mb_fix
