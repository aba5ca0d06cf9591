"""The zoo's errors: measured (measure.py's JSON) against fresh predictions, as a table.

    python benchmarks/zoo/report.py [tests/fixtures/zoo_h100.json]
        [--predictions benchmarks/results/zoo_h100_predictions.json] [--markdown FILE]
        [--readme [docs/accuracy.md]]

Predicts every case the results file measured (on this machine's CPU, as tests/test_zoo.py
does), prints a markdown table (case, family, recipe, measured and predicted allocated /
reserved peak and step time, errors), the median |error| and the worst case of each, the
cases that failed to trace and the cases whose measurement failed; writes the predictions
and errors to --predictions (JSON, with a version); `--readme` also writes the table and
its summary between the results file's markers in docs/accuracy.md (or the file given).
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT), str(ROOT / "benchmarks")]

import torch  # noqa: E402
from readme_block import replace_block  # noqa: E402

from gobrrr.errors import GobrrrError  # noqa: E402
from zoo import compare  # noqa: E402

VERSION = 1
RESULTS = ROOT / "tests" / "fixtures" / "zoo_h100.json"


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def load(path: Path) -> dict:
    if not path.exists():
        raise GobrrrError(
            f"{path} does not exist: measure the zoo first "
            "(python benchmarks/zoo/measure.py OUT.json on a GPU)"
        )
    return json.loads(path.read_text())


START = "<!-- zoo-table: start (benchmarks/zoo/report.py --readme) -->"
END = "<!-- zoo-table: end -->"


def markers(results: Path) -> tuple[str, str]:
    """The markers of this results file's table in docs/accuracy.md: the zoo's, or for another file
    (zoo_h100_holdout.json) its own, named by the file ("zoo-holdout-table")."""
    if results.name == RESULTS.name:
        return START, END
    name = results.stem.replace("_h100", "").replace("_", "-")
    return (
        f"<!-- {name}-table: start (benchmarks/zoo/report.py {results.name} --readme) -->",
        f"<!-- {name}-table: end -->",
    )


def write_readme(
    readme: Path, text: str, summary: list[str], marks: tuple[str, str] = (START, END)
) -> None:
    """Replace the block between the markers of `readme` by the table and its summary."""
    body = "\n".join(["", text, "", *(f"- {line}" for line in summary), ""])
    replace_block(readme, *marks, body)


def run(
    results: Path, predictions: Path, markdown: Path | None, readme: Path | None = None
) -> None:
    doc = load(results)
    rows = compare.measured_rows(doc)
    reruns = compare.rerun_steps(results.parent)
    errors = []
    for row in rows:
        errors.append(compare.compare_row(row, reruns=reruns))
        e = errors[-1]
        print(
            f"predicted {e.name}: " + (e.trace_error or f"{e.capture_s:.1f} s trace"),
            file=sys.stderr,
            flush=True,
        )
    text = compare.table(errors)
    print(text)
    print()
    for line in compare.summary(errors):
        print(line)
    for r in compare.failed_rows(doc):
        print(
            f"measurement failed: {r['name']}: {r['error']['type']}: "
            f"{r['error']['message'].splitlines()[0][:160] if r['error']['message'] else ''}"
        )
    if markdown:
        markdown.write_text(text + "\n")
    if readme:
        write_readme(readme, text, compare.summary(errors), markers(results))
    out = {
        "version": VERSION,
        "results": results.name,
        "gpu": compare.GPU,
        "gobrrr_commit": _commit(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "measured_environment": doc.get("environment"),
        "cases": [e.to_dict() for e in errors],
    }
    predictions.write_text(json.dumps(out, indent=1))
    print(f"wrote {predictions}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("results", nargs="?", default=str(RESULTS))
    ap.add_argument(
        "--predictions", default=None, help="default: the results file's name with _predictions"
    )
    ap.add_argument("--markdown", default=None, help="also write the table to this file")
    ap.add_argument(
        "--readme",
        nargs="?",
        const=str(ROOT / "docs" / "accuracy.md"),
        default=None,
        help="also put the table into docs/accuracy.md, or FILE (between its table markers)",
    )
    args = ap.parse_args(argv)
    results = Path(args.results)
    predictions = (
        Path(args.predictions)
        if args.predictions
        else results.with_name(results.stem + "_predictions.json")
    )
    try:
        run(
            results,
            predictions,
            Path(args.markdown) if args.markdown else None,
            Path(args.readme) if args.readme else None,
        )
    except GobrrrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
