"""docker/ cannot run here (no Docker engine): check what can be checked without it."""
from pathlib import Path

import yaml

from celery_delayed.settings import Settings

ROOT = Path(__file__).resolve().parents[2]


def compose():
    return yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())


def test_app_services_use_known_settings_and_the_real_commands():
    services = compose()["services"]
    settings = {f"DELAYED_{name.upper()}" for name in Settings.__dataclass_fields__}
    for name in ("poller", "worker", "flower"):
        env = services[name]["environment"]
        assert {k for k in env if k.startswith("DELAYED_")} <= settings, name
        Settings.from_mapping({k[len("DELAYED_"):].lower(): v for k, v in env.items() if k.startswith("DELAYED_")})
        assert services[name]["command"][:3] == ["celery", "-A", "tasks"]
    assert services["poller"]["command"][3:5] == ["delayed", "poller"]


def test_servers_listen_on_the_same_ports_as_scripts_services():
    services = compose()["services"]
    defaults = Settings()
    assert services["redis"]["ports"] == ["6379:6379"] and ":6379/" in defaults.redis_url
    assert services["etcd"]["ports"] == ["2379:2379"] and defaults.etcd_endpoints.endswith(":2379")
    assert services["kafka"]["ports"] == ["9092:9092"] and defaults.kafka_servers.endswith(":9092")


def test_dockerfile_copies_what_the_app_imports():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    for folder in ("celery_delayed", "tasks", "config"):
        assert f"COPY {folder}" in text


def test_the_image_installs_the_tested_versions():
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    assert "constraints.txt" in dockerfile and "-c constraints.txt" in dockerfile


def test_stateful_servers_keep_their_data_in_named_volumes():
    spec = compose()
    services = spec["services"]
    etcd_data = next(arg.split("=", 1)[1] for arg in services["etcd"]["command"] if arg.startswith("--data-dir="))
    assert f"etcd-data:{etcd_data}" in services["etcd"]["volumes"]
    assert "redis-data:/data" in services["redis"]["volumes"]  # the image's working dir: the AOF lands there
    assert {"etcd-data", "redis-data"} <= set(spec["volumes"])


def test_redis_never_evicts_scheduled_tasks():
    command = compose()["services"]["redis"]["command"]
    assert command[command.index("--maxmemory-policy") + 1] == "noeviction"
    assert command[command.index("--appendonly") + 1] == "yes"


def test_the_kafka_broker_sets_the_group_session_as_the_local_one_does():
    """The workers' KIP-848 session and heartbeat are broker settings: compose sets what scripts/services does."""
    import re

    properties = (ROOT / "config" / "kafka" / "server.properties").read_text()
    local = dict(re.findall(r"^(group\.consumer\.[a-z.]+)=(\d+)$", properties, re.M))
    kafka = yaml.safe_load((ROOT / "docker/compose.yaml").read_text())["services"]["kafka"]["environment"]
    assert local and {name: str(kafka.get("KAFKA_" + name.upper().replace(".", "_"))) for name in local} == local
