"""Record the small real GPU profiles the rule tests read in CI (run on a CUDA machine, from the repo root).

    python tests/data/record_gpu_fixtures.py OUT_DIR

Profiles every script under tests/rules/scripts and tests/rules/more/scripts and the two examples (at
their small default sizes, bf16 autocast), 2 warm-up + 3 recorded steps each, and writes
`OUT_DIR/<stem>.profile.json` plus the GPT example's `gpt_train.trace.json.gz`. Source paths inside are
made relative to the repository root, so the files load on any checkout: tests read them with
`tests/conftest.py:load_fixture_profile`, which puts the checkout's root back in front.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def relative(path: str | None) -> str | None:
    if not path:
        return path
    try:
        return str(Path(path).resolve().relative_to(ROOT))
    except ValueError:
        return path


def relocate(data: dict) -> dict:
    data["script"] = relative(data["script"])
    data["cwd"] = "."
    data["sources"] = {relative(k): v for k, v in data["sources"].items()}
    for key in ("ops", "annotations", "constructions"):
        for item in data.get(key, []):
            if item.get("file"):
                item["file"] = relative(item["file"])
    return data


def record(script: Path, out_dir: Path, args: list[str], keep_trace: bool = False) -> None:
    work = Path(tempfile.mkdtemp())
    run = work / "run"
    cmd = [
        sys.executable,
        "-m",
        "opadvisor",
        "profile",
        str(script),
        "--warmup",
        "2",
        "--steps",
        "3",
        "--out",
        str(run),
        "--",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        print(f"FAILED {script}: {proc.stderr[-2000:]}")
        return
    data = relocate(json.loads((run / "profile.json").read_text()))
    if not any(op.get("kernels") for op in data["ops"]):
        print(f"skipped {script.relative_to(ROOT)}: it ran no GPU kernels (CPU tensors), nothing to keep")
        return
    (out_dir / f"{script.stem}.profile.json").write_text(json.dumps(data, separators=(",", ":")))
    if keep_trace:
        shutil.copy(run / "trace.json.gz", out_dir / f"{script.stem}.trace.json.gz")
    print(f"recorded {script.relative_to(ROOT)}: {len(data['ops'])} ops, {len(data['steps'])} steps")


def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    scripts = sorted((ROOT / "tests" / "rules" / "scripts").glob("*.py"))
    scripts += sorted((ROOT / "tests" / "rules" / "more" / "scripts").glob("*.py"))
    for script in scripts:
        record(script, out_dir, [])
    record(ROOT / "examples" / "bert_train.py", out_dir, ["--steps", "100"])
    record(ROOT / "examples" / "gpt_train.py", out_dir, ["--steps", "100"], keep_trace=True)


if __name__ == "__main__":
    main()
