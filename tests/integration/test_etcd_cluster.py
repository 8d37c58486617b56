"""Leadership through a 3-member etcd cluster (scripts/services up etcd3) that loses its raft leader:
real etcd members, a real poller and worker process, ``kill -9`` of the member the poller talks to."""
from __future__ import annotations

import re
import subprocess
import time
import uuid
from datetime import datetime, timezone

import pytest
import redis

from tasks import create_app

from .support import ETCD3_ENDPOINTS, ETCD3_MEMBERS, etcd3_leader, etcd3_port, etcd3_status, leaders, wait_for


def connected_member(pid: int) -> int | None:
    """The etcd3 member the client of process ``pid`` uses now: the one its TCP connection sent to
    in the last second (a poller steps every 0.5 s; a channel to a member it failed over from may
    have reconnected and stay idle).  None while there is none, or more than one."""
    out = subprocess.run(["ss", "-tnpiH", "state", "established"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    ports = {etcd3_port(m): m for m in range(1, ETCD3_MEMBERS + 1)}
    members = set()
    for line, info in zip(out, out[1:]):  # a socket's line (Recv-Q Send-Q Local Peer Process), then its -i line
        peer = int(line.split()[3].rsplit(":", 1)[1]) if f"pid={pid}," in line else None
        last_send = re.search(r"lastsnd:(\d+)", info)
        if peer in ports and last_send and int(last_send.group(1)) < 1000:
            members.add(ports[peer])
    return members.pop() if len(members) == 1 else None


def move_leader(to: int) -> None:
    """Make etcd3 member ``to`` the raft leader (``etcdctl move-leader``, sent to the leader now)."""
    status = etcd3_status()
    leader = etcd3_leader()
    if leader == to:
        return
    subprocess.run(["etcdctl", "--endpoints", f"127.0.0.1:{etcd3_port(leader)}", "move-leader",
                    format(status[to]["header"]["member_id"], "x")], env={"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin"},
                   check=True, capture_output=True)
    wait_for(lambda: etcd3_leader() == to, 10, f"etcd3-{to} to lead")


@pytest.mark.parametrize("poller_on", ["leader", "follower"])
def test_a_poller_keeps_leading_and_loses_no_task_when_the_etcd_leader_is_killed(
        overrides, processes, servers, poller_on):
    """The poller leads 4 partitions through all 3 members (lease TTL 2 s).  The raft leader is
    killed with ``kill -9`` while tasks are due, and kept down 4 s (the other two elect a new
    leader), then started again; it is the member the poller's etcd client talks to (made leader
    first), or another one (the poller's member is then a follower that sees the election).
    Every task must run, the poller must lead every partition again, and dispatch must be back
    on time after the outage."""
    for member in range(1, ETCD3_MEMBERS + 1):
        servers.require_ours(f"etcd3-{member}")
    overrides.update(delayed_etcd_endpoints=ETCD3_ENDPOINTS)
    app = create_app(**overrides)
    settings = app.amqp.delayed_settings
    run = uuid.uuid4().hex
    poller = processes.poller()
    processes.worker("w1", "-c", "2")
    wait_for(lambda: set(leaders(settings).values()) == {poller.pid} and len(leaders(settings)) == settings.partitions,
             30, "the poller to lead every partition")
    n, spread_s, lead_s, rounds = 300, 26.0, 3.0, 2
    start_ms = int((time.time() + lead_s) * 1000)
    due = {}
    for i in range(n):
        due_ms = start_ms + int(i * spread_s * 1000 / n)
        eta = datetime.fromtimestamp(due_ms / 1000, timezone.utc)
        due[app.tasks["tasks.demo.fire"].apply_async((run, due_ms), eta=eta).id] = due_ms
    kills = []
    for i in range(rounds):  # twice: the second time the poller is on the member it failed over to
        time.sleep(max(0.0, start_ms / 1000 + 4 + 10 * i - time.time()))  # tasks run before and after
        member = wait_for(lambda: connected_member(poller.pid), 10, "the poller's connection to an etcd3 member")
        if poller_on == "follower":
            member = next(m for m in range(1, ETCD3_MEMBERS + 1) if m != member)
        move_leader(member)
        killed_ms = int(time.time() * 1000)
        servers.kill(f"etcd3-{member}")
        time.sleep(4)
        kills.append(f"etcd3-{member} (new leader etcd3-{etcd3_leader()})")
        servers.start(f"etcd3-{member}")

    r = redis.Redis.from_url(app.conf.delayed_redis_url)
    wait_for(lambda: r.hlen(f"demo:{run}:runs") >= n, spread_s + 60, f"all {n} tasks to run", interval=0.5)
    runs = {k.decode(): int(v) for k, v in r.hgetall(f"demo:{run}:runs").items()}
    lag = {task_id: app.backend.get_task_meta(task_id)["result"] for task_id in due}  # ms, of the first run
    led = leaders(settings)
    log = processes.log(poller)
    failed_steps = re.findall(r".*cannot prove leadership.*", log)
    # dispatch back on time once the outage is over: the member's 4 s down, a lease TTL, 2 s of slack
    back_ms = killed_ms + 4000 + settings.lease_ttl * 1000 + 2000
    late = {task_id: ms for task_id, ms in lag.items() if due[task_id] >= back_ms and ms > 1500}
    print(f"\nraft leader killed (the poller on the {poller_on}): {', '.join(kills)}; "
          f"{n} tasks: {len(runs)} ran, {sum(c > 1 for c in runs.values())} more than once; lag max "
          f"{max(lag.values())} ms; poller steps that could not prove leadership: {len(failed_steps)}")
    for line in failed_steps[:5]:
        print("  " + line[-160:])
    assert len(runs) == n, f"{n - len(runs)} tasks never ran"
    assert set(led.values()) == {poller.pid} and len(led) == settings.partitions, led
    assert not late, f"{len(late)} tasks due after the outage ran late, e.g. {sorted(late.values())[-5:]} ms"
    assert poller.poll() is None
