"""How many first-contact cases (tests/test_first_contact.py) a version of gobrrr passes.

    python benchmarks/cli/first_contact_corpus.py --before 4fd43f3 --out results/first_contact.json

Runs the corpus of this checkout against this checkout's sources and against the sources
of the commit `--before` (checked out into a temporary git worktree; the corpus file itself
always comes from this checkout), each in its own pytest process, and writes the counts and
the failing case ids. CPU only; about a minute.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CORPUS = ("test_first_contact.py", "first_contact_files.py")


def run_corpus(src: Path, tests: Path) -> dict:
    """Run the corpus in `tests` with `src` first on the path; passed, failed and the ids
    of the failing cases."""
    env = {**os.environ, "PYTHONPATH": str(src)}
    env.pop("GOBRRR_DEBUG", None)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        str(tests / CORPUS[0]),
        "-rf",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_first_contact[",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tests.parent).stdout
    failed = sorted(re.findall(r"FAILED \S+::test_first_contact\[(.+?)\]", out))
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed)", out)}  # the last
    return {"passed": counts.get("passed", 0), "failed": counts.get("failed", 0), "failing": failed}


def at_commit(commit: str, into: Path) -> Path:
    """A worktree of `commit` with this checkout's corpus copied into its tests/."""
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(into), commit],
        check=True,
        capture_output=True,
    )
    for name in CORPUS:
        shutil.copy(ROOT / "tests" / name, into / "tests" / name)
    return into


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", default="4fd43f3", help="the commit to compare with")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/first_contact_corpus.json"))
    args = ap.parse_args()
    after = run_corpus(ROOT / "src", ROOT / "tests")
    with tempfile.TemporaryDirectory() as tmp:
        old = at_commit(args.before, Path(tmp) / "before")
        try:
            before = run_corpus(old / "src", old / "tests")
        finally:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(old)],
                check=True,
                capture_output=True,
            )
    head = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    result = {
        "version": 1,
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cases": after["passed"] + after["failed"],
        "before": {"commit": args.before, **before},
        "after": {"commit": head, **after},
    }
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(
        f"{result['cases']} cases: {before['passed']} pass at {args.before}, "
        f"{after['passed']} at {head}  -> {args.out}"
    )


if __name__ == "__main__":
    main()
