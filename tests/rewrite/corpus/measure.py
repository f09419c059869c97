"""How many of the safe fixes `opadvisor suggest` offers on the corpus does `opadvisor apply` make, and do
they keep the losses? (the done-when measure of issue 19, on models written here in the styles of public
code: run it on the CPU, it needs no GPU)

    python tests/rewrite/corpus/measure.py [--keep DIR] [MODEL ...]     # default: every model here

For each model, in a fresh project folder: `opadvisor profile` (CPU, 2 steps after 1 warm-up), `opadvisor
suggest --format json` (the safe fixes it offers: fix "safe" with an apply command; two alternatives on the
same lines, sdpa_attention and fused_softmax, count as one site), `opadvisor apply --rule all`, then per
offered site whether the rewrite changed its lines, and `opadvisor verify --no-timing` (the losses of the
original and the rewrite, dropout off, same seeds). Prints one row per model, the fixes not applied with
the reason apply gave, the findings of the safe rules that suggest did not offer (fix_blocked: its reason),
the totals per pattern and in all; exits 1 when fewer than 90% are applied or a verify fails.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
TARGET = 0.9
SAFE_RULES = ("fused_softmax", "fused_dropout_add", "sdpa_attention", "manual_layernorm")


@dataclass
class Result:
    model: str
    offered: int = 0
    applied: int = 0
    parity: str = "-"
    missed: list[str] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    per_pattern: dict[str, list[int]] = field(default_factory=dict)

    def count(self, pattern: str, applied: bool) -> None:
        row = self.per_pattern.setdefault(pattern, [0, 0])
        row[0] += 1
        row[1] += int(applied)


def opadvisor(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "opadvisor", *args], cwd=cwd, capture_output=True, text=True)


def sites(findings: list[dict]) -> list[list[dict]]:
    """Offered safe fixes grouped by site: alternatives on the same lines are one site."""
    offered = [f for f in findings if f["fix"] == "safe" and f["apply"]]
    groups: list[list[dict]] = []
    for f in offered:
        alt = (f.get("details") or {}).get("alternative") or {}
        for group in groups:
            if any(
                g["rule"] == alt.get("rule") and g["line"] == alt.get("line") and g["path"] == f["path"]
                for g in group
            ):
                group.append(f)
                break
        else:
            groups.append([f])
    return groups


def measure(model: Path, root: Path) -> Result:
    from opadvisor.rewrite.engine import LineMap

    result = Result(model.stem)
    project = root / model.stem
    project.mkdir()
    shutil.copy(model, project / model.name)
    shutil.copy(HERE / "_train.py", project / "_train.py")
    done = opadvisor(project, "profile", model.name, "--steps", "2", "--warmup", "1", "--", "--steps", "6")
    if done.returncode != 0:
        result.parity = "profile failed"
        result.missed.append(
            done.stderr.strip().splitlines()[-1] if done.stderr.strip() else "profile failed"
        )
        return result
    doc = json.loads(opadvisor(project, "suggest", "--format", "json").stdout)
    groups = sites(doc["findings"])
    result.offered = len(groups)
    result.refused = [
        f"{f['path']}:{f['line']} {f['rule']}: {f['fix_blocked']}"
        for f in doc["findings"]
        if f["rule"] in SAFE_RULES and f.get("fix_blocked") and not f.get("apply")
    ]
    before = {p: (project / p).read_bytes() for p in {f["path"] for g in groups for f in g}}
    applied = opadvisor(project, "apply", "--rule", "all")
    for group in groups:
        f = group[0]
        line_map = LineMap(before[f["path"]], (project / f["path"]).read_bytes())
        pattern = "/".join(g["rule"] for g in group)
        done = any(line_map.map(g["line"], g["end_line"])[2] for g in group)
        result.count(pattern, done)
        if done:
            result.applied += 1
            continue
        why = [m for m in applied.stderr.splitlines() if f":{f['line']}:" in m and "not applied" in m]
        result.missed.append(
            f"{f['path']}:{f['line']} {'/'.join(g['rule'] for g in group)}: {why[0] if why else 'no reason given'}"
        )
    if result.applied:
        check = opadvisor(project, "verify", "--steps", "4", "--warmup", "0", "--no-timing", "--no-reprofile")
        result.parity = "match" if check.returncode == 0 else f"MISMATCH (exit {check.returncode})"
        if check.returncode != 0:
            result.missed.append((check.stdout + check.stderr).strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", help="corpus model names (default: all)")
    parser.add_argument("--keep", type=Path, help="keep the project folders here")
    args = parser.parse_args()
    models = [HERE / f"{m}.py" for m in args.models] or sorted(
        p for p in HERE.glob("*.py") if not p.name.startswith("_") and p.name != "measure.py"
    )
    root = args.keep or Path(tempfile.mkdtemp(prefix="opadvisor-corpus-"))
    root.mkdir(parents=True, exist_ok=True)
    results = [measure(m, root) for m in models]
    print(f"{'model':<20} {'offered':>7} {'applied':>7}  losses")
    for r in results:
        print(f"{r.model:<20} {r.offered:>7} {r.applied:>7}  {r.parity}")
        for line in r.missed:
            print(f"    not applied: {line}")
        for line in r.refused:
            print(f"    not offered: {line}")
    patterns: dict[str, list[int]] = {}
    for r in results:
        for pattern, (o, a) in r.per_pattern.items():
            patterns.setdefault(pattern, [0, 0])
            patterns[pattern][0] += o
            patterns[pattern][1] += a
    refused = sum(len(r.refused) for r in results)
    for pattern, (o, a) in sorted(patterns.items()):
        print(f"{pattern:<32} {o:>7} {a:>7}")
    print(f"{'not offered (fix_blocked)':<32} {refused:>7}")
    offered, applied = sum(r.offered for r in results), sum(r.applied for r in results)
    share = applied / offered if offered else 1.0
    parity_ok = all(r.parity in ("match", "-") for r in results)
    print(
        f"{'total':<20} {offered:>7} {applied:>7}  {share:.0%} applied; losses {'all match' if parity_ok else 'DIFFER'}"
    )
    if args.keep is None:
        shutil.rmtree(root, ignore_errors=True)
    return 0 if share >= TARGET and parity_ok else 1


if __name__ == "__main__":
    sys.exit(main())
