"""The vocabulary table of docs/concepts.md ("One word per concept") is what the CLI takes.

Each row names a word (an option, or the command ``reexecute``), the commands that take it, and
spellings no command may take. Read from each command's own parser, as ``--help`` prints it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from stepdump.cli.main import COMMANDS, build_parser

CONCEPTS = Path(__file__).resolve().parents[1] / "docs" / "concepts.md"


def options(command: str) -> set[str]:
    """Every option string ``stepdump COMMAND`` takes (``--step``, ``-o``, ...)."""
    parser = build_parser(command)
    sub = next(a for a in parser._actions if a.dest == "command")
    return {o for a in sub.choices[command]._actions for o in a.option_strings}  # type: ignore[attr-defined]


def rows() -> list[tuple[list[str], list[str], list[str]]]:
    """``(words, commands, not)`` of each row of the table."""
    text = CONCEPTS.read_text(encoding="utf-8")
    section = text.split("## One word per concept", 1)[1].split("\n## ", 1)[0]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 5 or cells[0] in ("concept", "---"):
            continue
        words = re.findall(r"`([^`]+)`", cells[1])
        commands = [re.sub(r"\(.*?\)", "", c).strip() for c in cells[2].split(",")]
        out.append((words, [c for c in commands if c], re.findall(r"`([^`]+)`", cells[4])))
    return out


ROWS = rows()


def test_the_table_is_there() -> None:
    assert len(ROWS) >= 8, ROWS


@pytest.mark.parametrize("words, commands, never", ROWS, ids=[r[0][0] for r in ROWS])
def test_each_command_takes_the_word_and_none_the_old_spelling(words: list[str], commands: list[str],
                                                               never: list[str]) -> None:
    if words == ["reexecute"]:
        assert "reexecute" in COMMANDS and "reexec" not in COMMANDS
        assert never == ["reexec"]
        return
    for command in commands:
        assert command in COMMANDS, f"the table names {command!r}, which is no command"
        missing = [w for w in words if w not in options(command)]
        assert not missing, f"stepdump {command} does not take {missing}"
    for spelling in never:
        parts = spelling.split()
        where = [parts[0]] if parts[0] in COMMANDS else list(COMMANDS)
        flag = parts[1] if parts[0] in COMMANDS else parts[0]
        if flag in words:  # `ls --steps` as a switch: the word itself, taken by others, not by ls
            assert all(flag not in options(c) for c in where), f"{spelling}: still taken"
            continue
        takers = [c for c in where if flag in options(c)]
        assert not takers, f"{flag} is the old spelling of {words}, still taken by {takers}"


def test_every_option_of_a_vocabulary_concept_is_in_the_table() -> None:
    """An option spelling the same ideas another way (``--output``, ``--name``, ``--kinds`` under
    another name) would be drift: every option with one of the table's stems is one of its words."""
    words = {w for ws, _, _ in ROWS for w in ws}
    stems = ("step", "kind", "name", "out")
    for command in COMMANDS:
        for o in options(command):
            if o.startswith("--") and any(o[2:].startswith(s) for s in stems) and o not in words:
                # --histogram-steps, --noise* and the like are other ideas; say which are allowed
                assert o in {"--histogram-steps"}, f"stepdump {command} {o}: not a word of the table"
