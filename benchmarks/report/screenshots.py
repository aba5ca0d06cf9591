"""Screenshots of each section of the HTML report, for the README: an estimate of gpt2, one
of the built-in ConvNet, and a plan of gpt2 under a 12 GiB budget. Each page is made by the
command line (`--html`), loaded in headless Chromium from a file URL with the network off,
checked to have drawn every chart without an error, and each section saved as
docs/images/report-<page>-<section>.png.

    PYTHONPATH=src:. python benchmarks/report/screenshots.py              # all three (~1 min)
    PYTHONPATH=src:. python benchmarks/report/screenshots.py --only convnet
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

from browser import Chromium  # noqa: E402

from gobrrr.cli.app import main as gobrrr  # noqa: E402

PAGES = {
    "gpt2": ["estimate", "--model", "gpt2", "--batch", "8", "--seq", "1024"],
    "convnet": ["estimate", "--model", "convnet", "--batch", "64"],
    "plan": [
        "plan",
        "--model",
        "gpt2",
        "--global-batch",
        "32",
        "--seq",
        "1024",
        "--memory-budget",
        "12GiB",
    ],
}


def shoot(name: str, args: list[str], out: Path, b: Chromium) -> list[Path]:
    """Make the page, load it, save one PNG per section."""
    with tempfile.TemporaryDirectory() as d:
        page = Path(d) / f"{name}.html"
        with contextlib.redirect_stdout(io.StringIO()):
            if gobrrr([*args, "--html", str(page)]) not in (0, 1):
                raise SystemExit(f"gobrrr {' '.join(args)} failed")
        loaded = b.load(page, timeout=60)
        if loaded.errors or loaded.rendered != len(loaded.charts) or loaded.requests:
            raise SystemExit(f"{name}: {loaded.errors or loaded.requests or 'not drawn'}")
        sections = b.evaluate("Array.from(document.querySelectorAll('section')).map(s => s.id)")
        return [b.screenshot_element(f"#{s}", out / f"report-{name}-{s}.png") for s in sections]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", choices=list(PAGES), default=list(PAGES))
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"))
    args = ap.parse_args()
    out = Path(args.out)
    with Chromium(width=1100, height=900) as b:
        for name in args.only:
            for p in shoot(name, PAGES[name], out, b):
                print(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p)


if __name__ == "__main__":
    main()
