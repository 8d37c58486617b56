"""The docs site's settings reference is generated from ``Settings``: every setting is in it, documented."""
from __future__ import annotations

import dataclasses
import importlib.util

from celery_delayed.settings import PREFIX, Settings
from tasks.processes import ROOT


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_settings_reference_has_a_documented_row_for_every_setting():
    rows = [line for line in _hooks().settings_reference().splitlines() if line.startswith("| `")]
    names = [row.split("`")[1] for row in rows]
    assert names == [PREFIX + field.name for field in dataclasses.fields(Settings)]
    assert all(row.rstrip(" |").split(" | ")[-1].strip() for row in rows), "a setting without its #: comment"
    group = next(row for row in rows if row.startswith("| `delayed_group_protocol`"))
    assert "`'auto'`" in group and "KIP-848" in group
