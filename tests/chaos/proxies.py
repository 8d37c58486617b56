"""Toxiproxy between each poller or worker (a host of :mod:`.network`) and the Redis and Kafka servers.

This kernel has no ``sch_netem``: links cannot be slowed by the kernel.  Each host gets a proxy per
server port on one toxiproxy-server of the run, and the host's connections to that port are sent to
its proxy (DNAT on the host's link, :meth:`.network.Host.redirect`), so the processes keep their
settings and Kafka's advertised address still works.  A fault puts a toxic on some hosts' proxies
(latency and jitter, ``timeout``: a server that accepts and never answers, ``reset_peer``: a reply
lost after the server ran the command) and takes it off again.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from tests.integration.support import Toxiproxy

from .network import Host


class Proxies:
    """The run's toxiproxy-server and its proxies, per host and server port."""

    def __init__(self, logdir: Path, ports: list[int], seed: int) -> None:
        self.ports = ports
        self.toxiproxy = Toxiproxy(logdir / "toxiproxy.log", seed)

    def route(self, host: Host) -> None:
        """Send the host's connections to each server port through a proxy of its own."""
        for port in self.ports:
            listen = self.toxiproxy.proxy(_name(host, port), f"127.0.0.1:{port}")
            host.redirect(port, int(listen.rsplit(":", 1)[1]))

    def toxic(self, hosts: list[Host], ports: list[int], kind: str, **attributes: Any
              ) -> contextlib.AbstractContextManager[None]:
        """While inside: toxic ``kind`` on the replies from ``ports`` to ``hosts``."""
        return self.toxiproxy.toxic([_name(h, p) for h in hosts for p in ports], kind, **attributes)

    def close(self) -> None:
        self.toxiproxy.close()


def _name(host: Host, port: int) -> str:
    return f"{host.name}-{port}"

