import pytest

from celery_delayed.worker.offsets import OffsetTracker, PartitionOffsets


def test_commit_stops_at_first_unsettled_offset():
    p = PartitionOffsets()
    for o in (10, 11, 12, 13):
        p.add(o)
    assert p.committable == 10
    p.settle(12)
    p.settle(13)
    assert p.committable == 10  # 10 and 11 still running
    p.settle(10)
    assert p.committable == 11
    p.settle(11)
    assert p.committable == 14
    assert len(p) == 0


def test_nothing_read_means_nothing_to_commit():
    assert PartitionOffsets().committable is None


def test_offsets_must_grow():
    p = PartitionOffsets()
    p.add(5)
    with pytest.raises(ValueError):
        p.add(5)


def test_settle_after_revoke_is_ignored():
    t = OffsetTracker()
    t.assign([("t", 0)])
    part = t.add(("t", 0), 7)
    assert part is not None
    assert t.revoke([("t", 0)]) == {("t", 0): 7}
    t.settle(part, 7)
    assert t.committable() == {}
    t.assign([("t", 0)])
    assert t.committable() == {}  # a fresh assignment starts from Kafka's committed offset


def test_records_of_unassigned_partitions_are_not_tracked():
    t = OffsetTracker()
    assert t.add(("t", 0), 1) is None  # read just before its partition was revoked
    assert t.committable() == {} and t.unsettled() == 0


def test_unsettled_counts_every_partition():
    t = OffsetTracker()
    t.assign([("t", 0), ("t", 1)])
    a, b = t.add(("t", 0), 1), t.add(("t", 1), 1)
    t.add(("t", 1), 2)
    assert t.unsettled() == 3
    t.settle(b, 1)
    assert t.unsettled() == 2
    assert t.committable() == {("t", 0): 1, ("t", 1): 2}
    t.settle(a, 1)
    assert t.committable() == {("t", 0): 2, ("t", 1): 2}


def test_records_settled_behind_a_slow_head_leave_the_unsettled_count_but_not_the_backlog():
    """One long task at the head of a partition: the records settled after it no longer count
    against the worker's prefetch limit, yet stay uncommitted (the backlog) until it ends."""
    t = OffsetTracker()
    t.assign([("t", 0)])
    p = t.add(("t", 0), 10)
    for offset in range(11, 20):
        t.add(("t", 0), offset)
        t.settle(p, offset)
    assert t.unsettled() == 1 and t.backlogs() == {("t", 0): 10}
    assert t.committable() == {("t", 0): 10}
    t.settle(p, 10)
    assert t.unsettled() == 0 and t.backlogs() == {("t", 0): 0} and t.committable() == {("t", 0): 20}


def test_a_partition_kafka_moves_back_is_tracked_afresh_and_none_of_its_records_is_dropped():
    """Kafka rewinds a partition under an assignment (its log truncated after a leader change, or
    the topic recreated): each record from there on is tracked and committed in order, and the
    settles of those read before the rewind no longer move the commit."""
    t = OffsetTracker()
    t.assign([("t", 0)])
    before = t.add(("t", 0), 10)
    t.add(("t", 0), 11)
    t.settle(before, 10)
    after = [t.add(("t", 0), offset) for offset in (3, 4, 5)]
    assert after[0] is not before and all(p is after[0] for p in after)
    assert t.committable() == {("t", 0): 3} and t.unsettled() == 3
    t.settle(before, 11)  # a task read before the rewind ends
    assert t.committable() == {("t", 0): 3}
    for offset in (4, 5):
        t.settle(after[0], offset)
    assert t.committable() == {("t", 0): 3}  # 3 still runs
    t.settle(after[0], 3)
    assert t.committable() == {("t", 0): 6} and t.unsettled() == 0


def test_records_below_where_kafka_moved_back_still_hold_the_commit_until_they_settle():
    """librdkafka seeks a truncated partition to where the logs diverge, which can be above a task
    still running: that record is still in the log, so the commit must not pass it (were the worker
    killed, nothing would read it again, and the store forgot it once Kafka had it)."""
    t, key = OffsetTracker(), ("t", 0)
    t.assign([key])
    before = [t.add(key, offset) for offset in range(12)][0]
    for offset in range(12):
        if offset != 5:  # 5: a long task
            t.settle(before, offset)
    after = t.add(key, 9)  # the log truncated to 0..8 after an unclean leader change, 9 and 10 new
    t.add(key, 10)
    t.settle(after, 9)
    t.settle(after, 10)
    t.settle(before, 10)  # the old record 10, gone from the log, ends: nothing to commit for it
    assert t.committable() == {key: 5} and t.unsettled() == 1 and t.backlogs() == {key: 4}
    t.settle(before, 5)
    assert t.committable() == {key: 11} and t.unsettled() == 0
    again = t.add(key, 0)  # moved back below everything (the topic recreated)
    assert t.committable() == {key: 0}
    t.settle(again, 0)
    assert t.revoke([key]) == {key: 1}


def test_a_second_move_back_above_the_first_keeps_the_count_of_what_the_worker_holds():
    """The earliest records read stay cut where the first move back cut them: a late settle of one
    cut off is ignored, not counted as settled (which made the worker think it held fewer)."""
    t, key = OffsetTracker(), ("t", 0)
    t.assign([key])
    first = [t.add(key, offset) for offset in range(3, 16)][0]
    for offset in range(10, 16):  # moved back to 10: 10 to 15 of the first reading are gone
        t.add(key, offset)
    t.add(key, 12)  # moved back to 12: 12 to 15 of the second reading are gone
    t.settle(first, 10)
    t.settle(first, 11)
    assert t.unsettled() == 7 + 2 + 1 and t.committable() == {key: 3}  # 3-9 first, 10-11 second, 12 third
