"""The README's command section lists exactly the options `gobrrr COMMAND --help` has."""

import argparse
import re
from pathlib import Path

import pytest

from gobrrr.cli.app import build_parser

README = Path(__file__).resolve().parents[1] / "README.md"


def commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def readme_synopsis() -> dict[str, set[str]]:
    """The options of each command in the README's synopsis block under '## Commands'."""
    section = README.read_text().split("## Commands", 1)[1].split("\n## ", 1)[0]
    block = section.split("```text", 1)[1].split("```", 1)[0]
    out: dict[str, set[str]] = {}
    command = None
    for line in block.splitlines():
        if line.startswith("gobrrr "):
            command = line.split()[1]
            out[command] = set()
        if command is not None:
            out[command] |= set(re.findall(r"--[a-z][a-z-]*", line))
    return out


def test_every_command_is_in_the_readme():
    assert set(readme_synopsis()) == set(commands())


@pytest.mark.parametrize("name", sorted(commands()))
def test_the_readme_lists_the_options_help_lists(name):
    parser = commands()[name]
    options = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    assert readme_synopsis()[name] == options - {"--help"}
