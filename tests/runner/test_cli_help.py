"""The top-level help describes the whole tool: every verb it has is named in it."""

from __future__ import annotations

from runner.cli import HELP, app


def test_top_level_help_names_every_verb() -> None:
    verbs = [c.name for c in app.registered_commands] + [g.name for g in app.registered_groups]
    assert len(verbs) >= 12, verbs
    missing = [
        v
        for v in verbs
        if v and f"{v}" not in HELP.replace(",", " ").replace("(", " ").replace(")", " ").split()
    ]
    assert not missing, f"the top-level help does not mention {missing}: {HELP}"
