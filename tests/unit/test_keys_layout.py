"""The key names: one builder, documented once, and the docs' Keys table (scheduled tasks page) is that
documentation."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from celery_delayed.store.keys import LAYOUT, Keys

PAGE = Path(__file__).resolve().parents[2] / "docs" / "scheduled-tasks.md"

#: Each documented pattern, built by Keys with placeholders for its variable parts.
K = Keys("<prefix>")
BUILT = {
    "<prefix>:{p}:t:<lane>:<start>": K.bucket("p", "<start>", "<lane>"),
    "<prefix>:{p}:buckets:<lane>": K.buckets("p", "<lane>"),
    "<prefix>:{p}:lanes": K.lanes("p"),
    "<prefix>:{p}:t:<start>": K.bucket("p", "<start>"),
    "<prefix>:{p}:buckets": K.buckets("p"),
    "<prefix>:{p}:msg": K.msgs("p"),
    "<prefix>:{p}:inflight": K.inflight("p"),
    "<prefix>:{p}:attempt": K.attempts("p"),
    "<prefix>:{p}:failing": K.failing("p"),
    "<prefix>:{p}:fence": K.fence("p"),
    "<prefix>:{p}:stamp": K.stamp("p"),
    "<prefix>:{p}:claim": K.last_claim("p"),
    "<prefix>:{p}:handover": K.handover("p"),
    "<prefix>:{p}:cancelled:<request>": K.cancelled("p", "<request>"),
    "<prefix>:{p}:keys": K.key_index("p"),
    "<prefix>:{p}:recurring": K.recurring("p"),
    "<prefix>:{p}:recurring:putting": K.recurring_putting("p"),
    "<prefix>:{p}:wait": K.wait_probe("p"),
    "<prefix>:run:{<crc>}<id>": K.run("<id>"),
    "<prefix>:revoked:{<crc>}<id>": K.revoked("<id>"),
    "<prefix>:done:{<crc>}<id>": K.done("<id>"),
    "<prefix>:{dlq}:msg": K.dlq[0],
    "<prefix>:{dlq}:index": K.dlq[1],
    "<prefix>:{dlq}:wait": K.dlq_wait,
    "<prefix>:layout": K.layout,
    "<prefix>:paused": K.paused,
    "<prefix>:rates": K.rates,
    "<prefix>:tokens:<queue>": K.tokens("<queue>"),
    "<prefix>:wake": K.wake,
    "/<prefix>/leader/<p>": K.leader("<p>"),
    "/<prefix>/pollers/<id>": K.poller("<id>"),
    "/<prefix>/epoch": K.epoch(),
}


@pytest.mark.parametrize("pattern", [row[0] for row in LAYOUT])
def test_each_documented_key_is_the_one_keys_builds(pattern):
    built = re.sub(r"\{[0-9a-f]{8}\}", "{<crc>}", BUILT[pattern])  # the CRC-32 of "<id>"
    assert built == pattern


def test_the_layout_documents_every_key_keys_builds():
    assert [row[0] for row in LAYOUT] == list(BUILT)


def test_the_readme_key_table_is_the_layout():
    rows = re.findall(r"^\| `([^`]+)` \| (\S+) \| (.+) \|$", PAGE.read_text(), re.MULTILINE)
    documented = [row for row in rows if row[0].startswith(("<prefix>", "/<prefix>"))]
    assert documented == [tuple(row) for row in LAYOUT], "regenerate the docs' key table from keys.LAYOUT"


def test_a_task_ids_records_share_one_cluster_slot_whatever_braces_the_id_holds():
    from redis.crc import key_slot

    for task_id in ("plain", "{odd}id", "a}b{c"):
        assert len({key_slot(Keys("cd").task(kind, task_id).encode()) for kind in ("run", "revoked", "done")}) == 1
