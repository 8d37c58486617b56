"""The chaos suite: a load of scheduled tasks under injected faults, checked task by task.

    python -m tests.chaos [--quick] [--seed N] [--tasks N] [--faults a,b,...] [--store {redis,cluster}]

2 pollers and 2 prefork workers (real OS processes) on the servers of
scripts/services run a load of ``tasks.chaos.step`` tasks due over a few
minutes (some retry once through the store, write a side effect through the
task id as idempotency key, are revoked or rescheduled while scheduled, or
fail for good; more are sent one by one by ``apply_async`` while the faults
run, as a client would), while a seeded schedule of faults kills, pauses and starves
pollers and workers, restarts Redis, Kafka and etcd (the pollers lead through
the 3-member etcd cluster ``etcd3`` of scripts/services; one fault kills its
raft leader) and (``--store cluster``) fails a Redis Cluster primary over to
its replica; links are slowed, silenced and made to lose replies through Toxiproxy, and
wall clocks stepped under libfaketime.  Every execution is
recorded in a SQLite ledger outside the servers; the ledger is then checked
by task id, and each fault is charged with the losses, duplicates and
recovery time that follow it.  Results go to ``tests/chaos/results/``.
"""
