"""edgefl --help names every sub-command in its description, as the README's command list does."""

from __future__ import annotations

import argparse

from edgefl.cli import build_parser


def test_cli_help_description_names_every_subcommand() -> None:
    parser = build_parser(["--help"])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    names = sorted(sub.choices)
    assert "keys" in names and "coordinator" in names, names
    description = parser.description or ""
    listed = description[description.index("(") + 1 : description.rindex(")")]
    assert sorted(w.strip() for w in listed.split(",")) == names
