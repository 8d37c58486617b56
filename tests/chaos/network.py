"""Test hosts for the chaos suite's link faults: each poller or worker in its own network namespace.

A host is a namespace joined to this machine by a veth pair (``10.X.N.2`` inside, ``10.X.N.1``
outside).  Inside, every TCP connection to 127.0.0.1 is sent to the outside end (DNAT), and
outside it is delivered to 127.0.0.1 again, with 127.0.0.1 as its source (so Redis' protected
mode and the servers' loopback binds stay as they are, and Kafka's advertised 127.0.0.1 works).
The servers stay where scripts/services started them; what crosses the veth pair is one host's
links, which :meth:`Host.cut` drops silently (a partition: packets vanish both ways, as on a
network, not refused) or :meth:`Host.lose` drops at random, per server port, and
:meth:`Host.redirect` sends through a fault proxy (:mod:`.proxies`).

This kernel has no ``sch_netem`` (``tc qdisc add ... netem`` says "Specified qdisc kind is
unknown"), so delay and jitter cannot be added; loss is iptables' ``statistic`` match.  Every
rule carries the run's comment; :meth:`Hosts.close` removes the rules, links and namespaces
the run made, and nothing else.  Needs root, ``ip`` and ``iptables`` (``scripts/services network``).
"""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass, field


def available() -> str | None:
    """Why the hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [tool for tool in ("ip", "iptables") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (scripts/services network installs them)" if missing else None


def _run(*args: str) -> None:
    out = subprocess.run(args, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"{' '.join(args)}: {out.stderr.strip() or out.returncode}")


@dataclass
class Host:
    """One network namespace with a veth link to this machine; its faults are per server port."""

    name: str
    outer: str          # the veth end on this machine
    inner: str          # the veth end in the namespace
    tag: str            # the iptables comment of the run
    faults: list[tuple[list[str], list[str]]] = field(default_factory=list)  # (command prefix, rule) in force

    @property
    def wrap(self) -> list[str]:
        """The command prefix that runs a program in this host (``ip netns exec`` keeps its pid)."""
        return ["ip", "netns", "exec", self.name]

    def cut(self, ports: list[int]) -> None:
        """Drop every packet between this host and the servers on ``ports``, both ways."""
        self._drop(ports, [])

    def lose(self, ports: list[int], probability: float) -> None:
        """Drop each packet between this host and the servers on ``ports`` with ``probability``, both ways."""
        self._drop(ports, ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.3f}"])

    def redirect(self, port: int, to_port: int) -> None:
        """Send this host's connections to 127.0.0.1:``port`` to 127.0.0.1:``to_port`` instead (a proxy
        of :mod:`.proxies`); its link faults still match ``port``, as their rules act before NAT."""
        _run("iptables", "-t", "nat", "-I", "PREROUTING", "1", "-i", self.outer, "-p", "tcp", "--dport", str(port),
             "-m", "comment", "--comment", self.tag, "-j", "DNAT", "--to-destination", f"127.0.0.1:{to_port}")

    def heal(self) -> None:
        """Remove the faults in force: the links work again (connections that survived carry on)."""
        while self.faults:
            prefix, rule = self.faults.pop()
            _run(*prefix, "iptables", "-t", "raw", "-D", "PREROUTING", *rule)

    def _drop(self, ports: list[int], match: list[str]) -> None:
        # raw PREROUTING: before conntrack and NAT, so a dropped packet leaves no trace, as on a wire;
        # inside, the servers' packets come from their port; outside, the host's go to it.
        for port in ports:
            for prefix, iface, way in ((self.wrap, self.inner, "--sport"), ([], self.outer, "--dport")):
                rule = ["-i", iface, "-p", "tcp", way, str(port), *match, "-m", "comment", "--comment", self.tag,
                        "-j", "DROP"]
                _run(*prefix, "iptables", "-t", "raw", "-A", "PREROUTING", *rule)
                self.faults.append((prefix, rule))


class Hosts:
    """The hosts of one run: made on demand, all removed by :meth:`close`."""

    def __init__(self, run_id: int | None = None) -> None:
        self.run_id = os.getpid() if run_id is None else run_id
        self.tag = f"cd-chaos-{self.run_id}"
        self.net = 64 + self.run_id % 128  # 10.<net>.<n>.0/30 for host n
        self.hosts: list[Host] = []

    def add(self) -> Host:
        """A new host, its links working."""
        n = len(self.hosts) + 1
        if n > 255:
            raise RuntimeError("a run makes at most 255 hosts")
        host = Host(f"cd{self.run_id}n{n}", f"cd{self.run_id}o{n}", f"cd{self.run_id}i{n}", self.tag)
        outer_ip, inner_ip = f"10.{self.net}.{n}.1", f"10.{self.net}.{n}.2"
        self.hosts.append(host)  # before it exists: close() removes what was made of it
        inside = host.wrap
        for command in (
            ["ip", "netns", "add", host.name],
            ["ip", "link", "add", host.outer, "type", "veth", "peer", "name", host.inner],
            ["ip", "link", "set", host.inner, "netns", host.name],
            ["ip", "addr", "add", f"{outer_ip}/30", "dev", host.outer],
            ["ip", "link", "set", host.outer, "up"],
            ["sysctl", "-qw", f"net.ipv4.conf.{host.outer}.route_localnet=1"],
            [*inside, "ip", "addr", "add", f"{inner_ip}/30", "dev", host.inner],
            [*inside, "ip", "link", "set", host.inner, "up"],
            [*inside, "ip", "link", "set", "lo", "up"],
            [*inside, "ip", "route", "add", "default", "via", outer_ip],
            [*inside, "sysctl", "-qw", "net.ipv4.conf.all.route_localnet=1"],
            # inside: a connection to 127.0.0.1 goes out to this machine, from the inner address
            [*inside, "iptables", "-t", "nat", "-A", "OUTPUT", "-p", "tcp", "-d", "127.0.0.1", "-j", "DNAT",
             "--to-destination", outer_ip],
            [*inside, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", host.inner, "-j", "MASQUERADE"],
            # outside: delivered to the servers on 127.0.0.1, as if from 127.0.0.1
            ["iptables", "-t", "nat", "-A", "PREROUTING", "-i", host.outer, "-p", "tcp", "-d", outer_ip,
             "-m", "comment", "--comment", self.tag, "-j", "DNAT", "--to-destination", "127.0.0.1"],
            ["iptables", "-t", "nat", "-A", "INPUT", "-i", host.outer, "-p", "tcp",
             "-m", "comment", "--comment", self.tag, "-j", "SNAT", "--to-source", "127.0.0.1"],
        ):
            _run(*command)
        return host

    def close(self) -> None:
        """Remove every rule, link and namespace of this run (the processes in them were stopped)."""
        for table in ("nat", "raw"):
            rules = subprocess.run(["iptables", "-t", table, "-S"], capture_output=True, text=True).stdout
            for line in rules.splitlines():
                if f'"{self.tag}"' in line or f" {self.tag} " in line:
                    subprocess.run(["iptables", "-t", table, *line.replace("-A", "-D", 1).split()],
                                   capture_output=True)
        for host in self.hosts:
            subprocess.run(["ip", "link", "del", host.outer], capture_output=True)
            subprocess.run(["ip", "netns", "del", host.name], capture_output=True)
        self.hosts.clear()
