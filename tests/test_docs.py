"""The docs describe what exists: every CLI command and option, every recorded column, every rule field."""

import argparse
from pathlib import Path

from bitguard.backend.rules import ACTIONS, MATCH_FIELDS
from bitguard.cli import build_parser
from bitguard.schema import markdown

ROOT = Path(__file__).resolve().parents[1]


def test_schema_doc_is_generated_from_the_schema():
    assert (ROOT / "docs" / "SCHEMA.md").read_text() == markdown(), \
        "docs/SCHEMA.md is stale: regenerate it (see bitguard.schema.markdown)"


def test_every_cli_command_and_option_is_in_the_readme():
    readme = (ROOT / "README.md").read_text()
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        assert f"bitguard {name}" in readme, f"README does not show 'bitguard {name}'"
        for action in p._actions:
            names = [o for o in action.option_strings if o not in ("-h", "--help")]
            if names:
                assert any(f"{o} " in readme or f"{o}]" in readme or f"{o}`" in readme for o in names), \
                    f"README does not mention '{name} {names[-1]}'"


def test_every_rule_field_and_action_is_documented():
    doc = (ROOT / "docs" / "RULES.md").read_text()
    for field in MATCH_FIELDS:
        assert f"match.{field}" in doc, field
    for action in ACTIONS:
        assert f"`{action}`" in doc, action


def test_readme_first_screen_has_exactly_two_setup_commands():
    head = (ROOT / "README.md").read_text().split("---")[0]
    block = head.split("```bash")[1].split("```")[0]
    commands = [line for line in block.splitlines() if line.strip()]
    assert [c.split()[0:2] for c in commands] == [["make", "demo"], ["make", "test"]]
