"""JSON schema (draft 2020-12) of `opadvisor suggest --format json`, schema version 1.

The first keys of the document and of each finding are the contract in DESIGN.md, with the types it
gives (times are null where the profile cannot give them); the keys after them add what the table shows
(evidence, notes for rules that did not apply, the step breakdown). Scripts may rely on every key here;
a change that removes or retypes one bumps `schema`. Kept as a Python dict so it ships with the package.

    import jsonschema
    from opadvisor.rules.suggest_schema import SUGGEST_SCHEMA
    jsonschema.validate(document, SUGGEST_SCHEMA)
"""

from __future__ import annotations

from typing import Any

_NUM_OR_NULL: dict[str, Any] = {"type": ["number", "null"]}
_LINE: dict[str, Any] = {"type": "integer", "minimum": 1}
_STR_OR_NULL: dict[str, Any] = {"type": ["string", "null"]}
_USER_LINE: dict[str, Any] = {  # a place in the user's code
    "type": ["object", "null"],
    "required": ["path", "line"],
    "properties": {"path": {"type": "string"}, "line": _LINE},
}

# A finding whose pattern is written in an installed library's code (its `path`/`line` are that file's):
# what the library is, whose code it is, where the user's code reached it, and the fix for library code.
LIBRARY_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": [
        "package",
        "version",
        "file",
        "line",
        "end_line",
        "function",
        "module_class",
        "called_from",
        "model",
        "fix",
    ],
    "properties": {
        "package": {"type": "string"},  # top-level import name: "transformers", "torch"
        "version": _STR_OR_NULL,
        "file": {"type": "string"},  # path within site-packages: "transformers/models/bert/modeling_bert.py"
        "line": _LINE,
        "end_line": _LINE,
        "function": _STR_OR_NULL,  # qualified: "BertSelfOutput.forward", "eager_attention_forward"
        "module_class": _STR_OR_NULL,  # "transformers.models.bert.modeling_bert.BertSelfAttention"
        "called_from": _USER_LINE,  # the user's line that called into the library
        "model": {  # where the script built or loaded the model (a patch is inserted after it)
            "type": ["object", "null"],
            "required": ["path", "line", "cls", "how"],
            "properties": {
                "path": _STR_OR_NULL,
                "line": {"type": ["integer", "null"]},
                "cls": {"type": "string"},
                "how": _STR_OR_NULL,  # "constructor", "from_pretrained", "from_config"
                "attn_implementation": _STR_OR_NULL,
            },
        },
        "fix": {
            "type": "object",
            "required": ["kind", "name", "safety", "summary", "rules", "advice"],
            "properties": {
                "kind": {"enum": ["switch", "patch", "rule", "none"]},
                "name": _STR_OR_NULL,  # opadvisor/libraries.py's fix name
                "safety": {"enum": ["safe", "unsafe", "none"]},
                "summary": _STR_OR_NULL,
                "rules": {"type": "array", "items": {"type": "string"}},
                "advice": {"type": "string"},
            },
        },
    },
}

FINDING_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "rule",
        "path",
        "line",
        "end_line",
        "message",
        "time_ms_per_step",
        "est_saving_ms_per_step",
        "fix",
        "time_basis",
        "profiled_time_ms_per_step",
        "share_of_step",
        "function",
        "module",
        "source_status",
        "ranks",
        "apply",
        "advice",
        "evidence",
        "details",
    ],
    "additionalProperties": False,
    "properties": {
        # ---- DESIGN.md's contract
        "rule": {"type": "string", "pattern": "^[a-z][a-z0-9_]*$"},
        "path": {"type": "string", "minLength": 1},  # relative to the cwd when under it, else absolute
        "line": _LINE,
        "end_line": _LINE,
        "message": {"type": "string", "minLength": 1},
        "time_ms_per_step": _NUM_OR_NULL,
        "est_saving_ms_per_step": _NUM_OR_NULL,
        "fix": {"enum": ["safe", "unsafe", "none"]},
        # ---- additions
        "time_basis": {"enum": ["gpu", "cpu", "none"]},  # what time_ms_per_step measures
        # the time as measured under the profiler when its GPU idle part was scaled to the plain step
        # (see "calibration"); null for every other finding
        "profiled_time_ms_per_step": _NUM_OR_NULL,
        "share_of_step": _NUM_OR_NULL,  # 0..1 of the median step (the plain one once calibrated)
        "function": {"type": ["string", "null"]},
        "module": {"type": ["string", "null"]},
        "source_status": {"enum": ["ok", "changed", "missing"]},  # the file now vs. at profile time
        "ranks": {"type": ["array", "null"], "items": {"type": "integer", "minimum": 0}},
        "apply": {"type": ["string", "null"]},  # the command that applies the fix, null when display-only
        "advice": {"type": "string"},
        "evidence": {
            "type": "object",
            "required": ["ops", "kernel_count", "shapes", "dtypes", "occurrences", "notes"],
            "additionalProperties": False,
            "properties": {
                "ops": {"type": "array", "items": {"type": "string"}},
                "kernel_count": {"type": ["integer", "null"], "minimum": 0},
                "shapes": {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}},
                "dtypes": {"type": "array", "items": {"type": "string"}},
                "occurrences": {"type": "integer", "minimum": 1},
                "notes": {"type": "array", "items": {"type": "string"}},
            },
        },
        "details": {"type": "object"},  # rule-specific facts (what `apply` uses)
        "library": LIBRARY_SCHEMA,  # null for the user's own code
        # why the automatic fix cannot be applied here (then fix is "none"); absent when it can
        "fix_blocked": {"type": ["string", "null"]},
    },
}

_BYTES_OR_NULL: dict[str, Any] = {"type": ["integer", "null"], "minimum": 0}

# The run's memory (issue 22): CUDA peaks of the step against the device, and who holds the activation
# memory saved for backward (opadvisor/profile/memory.py). null for a run that measured none.
MEMORY_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "required": [
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "device_bytes",
        "peak_share_of_device",
        "allocated_at_start_bytes",
        "saved_bytes_per_step",
        "holders",
        "notes",
    ],
    "additionalProperties": False,
    "properties": {
        "peak_allocated_bytes": _BYTES_OR_NULL,  # the largest per-step peak of bytes in live tensors (CUDA)
        "peak_reserved_bytes": _BYTES_OR_NULL,  # ... of bytes the allocator held from the device
        "device_bytes": _BYTES_OR_NULL,  # the GPU's memory
        "peak_share_of_device": _NUM_OR_NULL,  # peak_reserved_bytes / device_bytes
        "allocated_at_start_bytes": _BYTES_OR_NULL,  # bytes live when a step starts (weights, optimizer)
        "saved_bytes_per_step": _BYTES_OR_NULL,  # activation memory saved for backward, mean per step
        "holders": {  # largest first: groups of repeated blocks, single modules, "(outside modules)"
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "module_class", "modules", "saved_bytes", "share"],
                "additionalProperties": False,
                "properties": {
                    "name": {"type": "string"},
                    "module_class": {"type": ["string", "null"]},
                    "modules": {"type": "array", "items": {"type": "string"}},
                    "saved_bytes": {"type": "integer", "minimum": 0},
                    "share": _NUM_OR_NULL,  # of saved_bytes_per_step
                },
            },
        },
        "notes": {"type": "array", "items": {"type": "string"}},  # why something was not measured
    },
}

# The plain step (timed without the profiler) and how idle-based times were scaled to it; see
# opadvisor/rules/_calibration.py. Times are ms per step; null where the run cannot give them.
CALIBRATION_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": [
        "plain_step_ms",
        "profiled_step_ms",
        "plain_steps_timed",
        "method",
        "gpu_busy_ms",
        "profiled_idle_ms",
        "plain_idle_ms",
        "idle_scale",
        "calibrated",
    ],
    "additionalProperties": False,
    "properties": {
        "plain_step_ms": _NUM_OR_NULL,  # median of the steps timed without the profiler
        "profiled_step_ms": _NUM_OR_NULL,  # median step under the profiler (= step_ms)
        "plain_steps_timed": {"type": "integer", "minimum": 0},
        "method": {"enum": ["cuda_sync", "wall", None]},
        "gpu_busy_ms": _NUM_OR_NULL,
        "profiled_idle_ms": _NUM_OR_NULL,
        "plain_idle_ms": _NUM_OR_NULL,
        "idle_scale": {"type": "number", "minimum": 0, "maximum": 1},
        "calibrated": {"type": "boolean"},  # GPU idle times were scaled to the plain step
    },
}

SUGGEST_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "opadvisor suggest --format json",
    "type": "object",
    "required": [
        "schema",
        "run",
        "device",
        "step_ms",
        "findings",
        "notes",
        "breakdown",
        "rules_run",
        "memory",
        "recording",
        "calibration",
    ],
    "additionalProperties": False,
    "properties": {
        # ---- DESIGN.md's contract
        "schema": {"const": 1},
        "run": {"type": "string"},
        "device": {"type": "string"},  # the GPU's name, or "cpu"
        "step_ms": _NUM_OR_NULL,  # median step wall time, under the profiler
        "findings": {"type": "array", "items": FINDING_SCHEMA},
        # ---- additions
        "cross_rank": {  # multi-rank runs only: opadvisor/ranks/cross_rank.py's to_json
            "type": "object",
            "required": ["schema"],
            "properties": {"schema": {"const": 1}},
        },
        "notes": {  # rules that did not apply to this profile (or failed), never findings
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rule", "message", "ranks"],
                "additionalProperties": False,
                "properties": {
                    "rule": {"type": "string"},
                    "message": {"type": "string"},
                    "ranks": {"type": ["array", "null"], "items": {"type": "integer"}},
                },
            },
        },
        "calibration": CALIBRATION_SCHEMA,
        "breakdown": {
            "type": "object",
            "required": ["basis", "step_ms", "total_ms", "of", "calibrated", "parts"],
            "additionalProperties": False,
            "properties": {
                "basis": {"enum": ["gpu", "cpu"]},
                "step_ms": _NUM_OR_NULL,
                # what the parts add up to and the shares are of (issue 30): `of` says which time it is
                "total_ms": {"type": "number"},
                "of": {"type": "string"},
                "calibrated": {"type": "boolean"},  # idle parts scaled to the plain step
                "parts": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name", "ms", "share", "profiled_ms"],
                        "additionalProperties": False,
                        "properties": {
                            "name": {"type": "string"},
                            "ms": {"type": "number"},
                            "share": _NUM_OR_NULL,
                            "profiled_ms": _NUM_OR_NULL,  # before scaling; null when not scaled
                        },
                    },
                },
            },
        },
        "rules_run": {"type": "array", "items": {"type": "string"}},
        "memory": MEMORY_SCHEMA,
        "recording": {  # false: the script ended or failed before the window was recorded in full
            "type": "object",
            "required": ["complete", "steps_recorded", "steps_requested"],
            "additionalProperties": False,
            "properties": {
                "complete": {"type": "boolean"},
                "steps_recorded": {"type": "integer", "minimum": 0},  # the fewest of any rank
                "steps_requested": {"type": "integer", "minimum": 0},
                # issue 30, incomplete runs: why the window stopped, steps run in all, the warm-up asked
                "stopped": {"enum": ["script_error", "script_exit", "ended_early", "interrupted"]},
                "steps_seen": {"type": "integer", "minimum": 0},
                "warmup_steps": {"type": "integer", "minimum": 0},
            },
        },
        # time inside torch.compile graphs, which no rule analyses (null: none ran compiled)
        "compiled": {
            "type": ["object", "null"],
            "required": ["ms_per_step", "share_of_step", "basis", "graphs"],
            "additionalProperties": False,
            "properties": {
                "ms_per_step": {"type": "number"},
                "share_of_step": _NUM_OR_NULL,
                "basis": {"enum": ["gpu", "cpu"]},
                "graphs": {"type": "integer", "minimum": 0},
                # issue 33: seconds torch.compile spent on the user's code, in all and in the first step
                # (the rest is recompiles); null in runs that recorded no compiles
                "compile_s": _NUM_OR_NULL,
                "compile_s_first_step": _NUM_OR_NULL,
            },
        },
        "eager": {"type": "boolean"},  # profiled with `opadvisor profile --eager` (torch.compile off)
    },
}
