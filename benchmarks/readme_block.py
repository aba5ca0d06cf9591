"""The one way a benchmark writes its table into a docs page: between two marker lines.

write_table(DOC, START, END, table)     # from a benchmark's --readme

The measured tables live in docs/accuracy.md (the zoo, held-out, multi-GPU, torchtitan and
planner tables); each script's `--readme` writes there unless given another file.
"""

from __future__ import annotations

from pathlib import Path

from gobrrr.errors import GobrrrError


def replace_block(readme: Path, start: str, end: str, body: str) -> None:
    """`readme` with what stands between its `start` and `end` markers replaced by `body`,
    everything else as it was; a GobrrrError naming the markers where it has none."""
    doc = readme.read_text()
    if start not in doc or end not in doc:
        raise GobrrrError(f"{readme} has no table markers ({start} ... {end})")
    head, rest = doc.split(start, 1)
    tail = rest.split(end, 1)[1]
    readme.write_text(head + start + body + end + tail)


def write_table(readme: Path, start: str, end: str, table: str) -> None:
    """`table` on its own lines between the markers of `readme`; a file without them ends
    the benchmark with the one-line message (SystemExit), as a command-line script should."""
    try:
        replace_block(readme, start, end, "\n" + table + "\n")
    except GobrrrError as e:
        raise SystemExit(str(e)) from None
