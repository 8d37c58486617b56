"""Text from the store is shown inert: in a terminal (the CLI) and in log lines."""
from __future__ import annotations

import io
import logging

import pytest

from celery_delayed.inert import inert


def test_control_and_bidi_characters_show_escaped_and_the_rest_as_written():
    assert inert("\x1b]0;title\x07\x1b[2J\r\n\t\x00\x7f\x85\u202e\u2066") == \
        "\\x1b]0;title\\x07\\x1b[2J\\r\\n\\t\\x00\\x7f\\x85\\u202e\\u2066"
    assert inert("tâche ✓ [bold]x[/bold] 'quoted' \\") == "tâche ✓ [bold]x[/bold] 'quoted' \\"


@pytest.mark.parametrize("module", ["celery_delayed.poller.delivery", "celery_delayed.worker.intake",
                                   "celery_delayed.client.intercept", "celery_delayed.ops.web.views"])
def test_a_task_id_holding_cr_lf_cannot_forge_a_log_line(module):
    """Each hop's logger formats its arguments inert; plain messages look as before."""
    __import__(module)
    log, out = logging.getLogger(module), io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.addHandler(handler)
    try:
        log.error("task %s: %r; %d tries, %.1f s", "t-1\r\nINFO forged\x1b[2J", "why\n", 3, 1.25)
        log.error("task %s: %s", "t-2", ValueError("reason\nINFO forged too"))
    finally:
        log.removeHandler(handler)
    assert out.getvalue().splitlines() == [
        "ERROR task t-1\\r\\nINFO forged\\x1b[2J: 'why\\n'; 3 tries, 1.2 s",
        "ERROR task t-2: reason\\nINFO forged too"]
