"""The benchmarks run on the servers of their own stack (``CD_*_PORT``), clean-ups included."""
import json
import subprocess
import sys

from tasks.processes import ROOT


def test_a_scenarios_settings_alone_reach_the_servers_on_the_runs_ports():
    """F9: a benchmark's clean-up builds its settings from the scenario's overrides alone; they named no
    server, so on a second stack (other CD_* ports) it deleted keys and topics of the default ports'
    servers and left its own behind."""
    script = ("import json; from bench.common import new_overrides; from celery_delayed.settings import Settings; "
              "s = Settings.from_conf(new_overrides(4)); "
              "print(json.dumps([s.redis_url, s.kafka_servers, s.etcd_endpoints]))")
    env = {"PATH": "/usr/bin:/bin", "CD_REDIS_PORT": "6479", "CD_KAFKA_PORT": "9192", "CD_ETCD_PORT": "2479"}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    redis_url, kafka_servers, etcd_endpoints = json.loads(out.stdout)
    assert ":6479/" in redis_url and kafka_servers.endswith(":9192") and etcd_endpoints.endswith(":2479")
