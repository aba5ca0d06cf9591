"""Every relative link in README.md and docs/*.md resolves: the file or folder exists, and a
`#anchor` names a heading of the page it points to (as GitHub makes heading anchors). The
measured tables live in docs/accuracy.md between the markers their scripts write, and the
README's quick start is the two commands `.ci/run` is held to."""

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

FENCE = re.compile(r"^```.*?^```", re.S | re.M)
COMMENT = re.compile(r"<!--.*?-->", re.S)
CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
MARKER = re.compile(r"<!-- ([\w-]+): start \((benchmarks/[\w/]+\.py)[^)]*\) -->")


def prose(text: str) -> str:
    """The text a reader sees as prose: code blocks, code spans and comments removed."""
    return CODE.sub("", COMMENT.sub("", FENCE.sub("", text)))


def links(page: Path) -> list[str]:
    """The targets of the page's links and images that are not URLs."""
    found = LINK.findall(prose(page.read_text()))
    return [t for t in found if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped (letters,
    digits, '-', '_' and spaces kept), spaces to '-'."""
    text = heading.strip().lower().replace("`", "")
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of the page's headings, repeated ones numbered (-1, -2) as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6} (.+)", line):
            s = slug(m.group(1))
            out.add(s if s not in seen else f"{s}-{seen[s]}")
            seen[s] = seen.get(s, 0) + 1
    return out


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def broken(page: Path) -> list[str]:
    """The page's relative links that do not resolve, each with why."""
    bad = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no {shown(dest)}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {shown(dest)}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    assert broken(page) == []


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Top\n[ok](a.md#two-words) [gone](b.md) [no anchor](a.md#three) [self](#top-1)\n"
        "`[code](c.md)` <!-- [comment](d.md) --> [web](https://example.com/x.md)\n"
        "```\n[fenced](e.md)\n```\n# Top\n"
    )
    assert [b.split(":")[0] for b in broken(page)] == ["b.md", "a.md#three"]
    assert "top-1" in anchors(page)


def test_slugs_match_github():
    assert slug("What to change: `plan` and `apply`") == "what-to-change-plan-and-apply"
    assert slug("Passes, `evaluate` and the schedule") == "passes-evaluate-and-the-schedule"
    assert slug("What a `Workload` must hold") == "what-a-workload-must-hold"


def test_measured_tables_live_in_accuracy_md():
    """Each table a benchmark writes (`--readme`) has both markers in docs/accuracy.md, names
    a script that exists, and none is left in the README."""
    doc = (ROOT / "docs" / "accuracy.md").read_text()
    starts = MARKER.findall(doc)
    assert {name for name, _ in starts} >= {
        "zoo-table",
        "zoo-holdout-table",
        "plan-table",
        "multigpu-table",
        "torchtitan-8b",
    }
    for name, script in starts:
        assert f"<!-- {name}: end -->" in doc
        assert (ROOT / script).exists(), script
    assert not MARKER.search((ROOT / "README.md").read_text())


def test_quick_start_is_the_two_commands_ci_runs():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("## Quick start", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in block.splitlines()]
    assert commands == ["bash .ci/setup && .venv/bin/gobrrr estimate", "bash .ci/run"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash .ci/setup" in ci and "-m pytest" in ci
