"""`opadvisor suggest --format sarif`: the findings report as SARIF 2.1.0, for code-scanning tools.

from opadvisor.report.sarif import sarif_document
sarif_document(report, profiles)   # one run: the rules that ran, one result per finding
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from opadvisor.report.findings import display_path, incomplete_words, library_entry, rounded

SARIF_SCHEMA_URI = "https://json.schemastore.org/sarif-2.1.0.json"
TOOL_URI = "https://github.com/opadvisor/opadvisor"


def _uri(path: str) -> dict[str, Any]:
    shown = display_path(path)
    if os.path.isabs(shown):
        return {"uri": Path(shown).as_uri()}
    return {"uri": Path(shown).as_posix(), "uriBaseId": "%SRCROOT%"}


def _location(path: str, line: int, end_line: int | None = None, text: str | None = None) -> dict[str, Any]:
    loc: dict[str, Any] = {
        "physicalLocation": {
            "artifactLocation": _uri(path),
            "region": {"startLine": max(1, line), "endLine": max(1, line, end_line or line)},
        }
    }
    if text:
        loc["message"] = {"text": text}
    return loc


def _fingerprint_path(f) -> str:
    """A library finding's fingerprint names the file within site-packages (stable across machines)."""
    return f.library["file"] if f.library else display_path(f.path)


def _related_locations(library: dict[str, Any]) -> list[dict[str, Any]]:
    """A library finding's user-code places: the call into the library, and where the model is built (the
    primary location is the library's line, where the pattern is written)."""
    related = []
    call = library.get("called_from")
    if call and call.get("path") and call.get("line"):
        related.append(_location(call["path"], call["line"], text="called from here"))
    model = library.get("model")
    if model and model.get("path") and model.get("line") and library["fix"]["kind"] != "none":
        related.append(
            _location(model["path"], model["line"], text="the model is built here (the fix goes here)")
        )
    for i, loc in enumerate(related):
        loc["id"] = i
    return related


def sarif_document(report, profiles) -> dict[str, Any]:
    """SARIF 2.1.0: one run, the rules that ran as reportingDescriptors, one result per finding; an
    incomplete run and the rules' notes as tool notifications."""
    from opadvisor import __version__
    from opadvisor.rules.overview import calibration

    index = {rid: i for i, rid in enumerate(report.rules_run)}
    run: dict[str, Any] = {
        "tool": {
            "driver": {
                "name": "opadvisor",
                "version": __version__,
                "informationUri": TOOL_URI,
                "rules": _descriptors(report.rules_run),
            }
        },
        "results": [_result(f, index) for f in report.findings],
        "columnKind": "unicodeCodePoints",
        "originalUriBaseIds": {"%SRCROOT%": {"uri": Path.cwd().resolve().as_uri() + "/"}},
    }
    notifications = _notifications(report, profiles)
    if notifications:
        run["invocations"] = [{"executionSuccessful": True, "toolExecutionNotifications": notifications}]
    run["properties"] = {"calibration": calibration(profiles[0]).to_json()}
    return {"$schema": SARIF_SCHEMA_URI, "version": "2.1.0", "runs": [run]}


def _descriptors(rule_ids: list[str]) -> list[dict[str, Any]]:
    """The rules that ran, as SARIF reportingDescriptors (their docstrings as help)."""
    from opadvisor.rules import registry

    descriptors = []
    for rid in rule_ids:
        mod = registry.get_rule(rid)
        doc = (mod.__doc__ or "").strip()
        descriptors.append(
            {
                "id": rid,
                "name": rid,
                "shortDescription": {"text": mod.TITLE},
                "fullDescription": {"text": doc.splitlines()[0] if doc else mod.TITLE},
                "help": {"text": doc or mod.TITLE},
                "properties": {"fix": mod.FIX},
            }
        )
    return descriptors


def _result(f, index: dict[str, int]) -> dict[str, Any]:
    """One finding as a SARIF result: a warning from 5% of the step, else a note."""
    share = f.evidence.share_of_step
    level = "warning" if share is not None and share >= 0.05 else "note"
    props: dict[str, Any] = {
        "time_ms_per_step": rounded(f.time_ms_per_step),
        "est_saving_ms_per_step": rounded(f.est_saving_ms_per_step),
        "fix": f.fix,
        "fix_blocked": f.fix_blocked,  # why the dry run found the fix cannot be made here (or null)
        "source_status": f.source_status,
    }
    if f.evidence.profiled_time_ms_per_step is not None:
        props["profiled_time_ms_per_step"] = rounded(f.evidence.profiled_time_ms_per_step)
    if f.ranks is not None:
        props["ranks"] = f.ranks
    text = f.message + (f". Fix: {f.advice}" if f.advice else "")
    result: dict[str, Any] = {
        "ruleId": f.rule,
        "ruleIndex": index.get(f.rule, 0),
        "level": level,
        "message": {"text": text},
        "locations": [_location(f.path, f.line, f.end_line)],
        "partialFingerprints": {"opadvisor/v1": f"{f.rule}:{_fingerprint_path(f)}:{f.line}"},
        "properties": props,
    }
    if f.library is not None:
        props["library"] = library_entry(f.library)
        related = _related_locations(f.library)
        if related:
            result["relatedLocations"] = related
    return result


def _notifications(report, profiles) -> list[dict[str, Any]]:
    """An incomplete run (a warning, first) and the rules' notes, as tool notifications."""
    notifications = [{"level": "note", "message": {"text": f"{n.rule}: {n.message}"}} for n in report.notes]
    incomplete = incomplete_words(profiles)
    if incomplete:
        notifications.insert(0, {"level": "warning", "message": {"text": incomplete}})
    return notifications
