"""The wheel as a user installs it (run by scripts/wheel-check with a clean venv's python, outside the
source tree): celery_delayed comes from site-packages, its Lua scripts, templates and stylesheet are
there, and a countdown task goes through the store, the wheel's own ``celery -A APP delayed poller``
and a stock ``celery worker`` to its result.  The servers are scripts/services' (CD_*_PORT)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from importlib.metadata import version
from importlib.resources import files
from pathlib import Path

APP = '''
import os
from celery import Celery
import celery_delayed

prefix = os.environ["WHEEL_CHECK_PREFIX"]
redis = f"redis://127.0.0.1:{os.environ.get('CD_REDIS_PORT', '6379')}"
app = Celery("wheelapp", broker=f"{redis}/1", backend=f"{redis}/2")
app.conf.update(
    task_default_queue=prefix, delayed_key_prefix=prefix, delayed_topic_prefix=prefix + ".",
    delayed_consumer_group=prefix, delayed_partitions=2, delayed_redis_url=f"{redis}/0",
    delayed_kafka_servers=f"127.0.0.1:{os.environ.get('CD_KAFKA_PORT', '9092')}",
    delayed_etcd_endpoints=f"http://127.0.0.1:{os.environ.get('CD_ETCD_PORT', '2379')}",
)
celery_delayed.install(app)


@app.task
def add(x, y):
    return x + y
'''


def _named(package: str, suffix: str) -> list[str]:
    try:
        return sorted(p.name for p in files(package).iterdir() if p.name.endswith(suffix))
    except (ModuleNotFoundError, OSError):  # the package or its folder is not in the wheel
        return []


def _data_files() -> dict[str, list[str]]:
    found = {package: _named(package, suffix)
             for package, suffix in (("celery_delayed.store.lua", ".lua"),
                                     ("celery_delayed.ops.web.templates", ".html"),
                                     ("celery_delayed.ops.web.static", ".css"))}
    empty = [package for package, names in found.items() if not names]
    if empty:
        raise SystemExit(f"the wheel has no data files in {empty}")
    return found


def main() -> int:
    import celery_delayed
    from celery_delayed import store_of
    from celery_delayed.sandbox import remove_everything

    source = Path(celery_delayed.__file__).resolve()
    if "site-packages" not in source.parts:
        raise SystemExit(f"celery_delayed was imported from {source}, not from the installed wheel")
    print(f"celery-delayed {version('celery-delayed')} from {source.parent}")
    print("data files: " + ", ".join(f"{p} {len(n)}" for p, n in _data_files().items()))
    work = Path(tempfile.mkdtemp(prefix="wheel-check-"))
    (work / "wheelapp.py").write_text(APP)
    prefix = f"wheel{uuid.uuid4().hex[:8]}"
    os.environ["WHEEL_CHECK_PREFIX"] = prefix
    sys.path.insert(0, str(work))
    import wheelapp

    celery = str(Path(sys.executable).parent / "celery")
    env = dict(os.environ, PYTHONPATH=str(work))
    started = []
    try:
        for name, args in (("poller", ["delayed", "poller", "-l", "INFO"]),
                           ("worker", ["worker", "-l", "INFO", "-c", "1", "-Q", prefix, "-n", f"{prefix}@%h"])):
            started.append(subprocess.Popen([celery, "-A", "wheelapp", *args], cwd=work, env=env,
                                            stdout=(work / f"{name}.log").open("wb"), stderr=subprocess.STDOUT,
                                            start_new_session=True))
        due = time.time() + 3  # before the call: the ETA apply_async computes is no earlier than this
        result = wheelapp.add.apply_async((2, 3), countdown=3)
        if store_of(wheelapp.app).get(result.id) is None:
            raise SystemExit("the countdown task is not in the delayed store")
        value = result.get(timeout=120)
        ran_late_s = time.time() - due
        status = subprocess.run([celery, "-A", "wheelapp", "delayed", "status"], cwd=work, env=env,
                                capture_output=True, text=True, timeout=60)
        if value != 5 or ran_late_s < 0 or status.returncode:
            raise SystemExit(f"result {value!r}, {ran_late_s:+.1f} s after due; `celery delayed status` exit "
                             f"{status.returncode}: {status.stderr[-500:]}")
        print(f"countdown task ran through the store and Kafka: result {value}, {ran_late_s:.2f} s after due "
              f"(the result wait included); `celery -A wheelapp delayed status` answered")
        return 0
    except BaseException:
        for log in sorted(work.glob("*.log")):
            print(f"----- {log.name} -----\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        for proc in started:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            except ProcessLookupError:
                pass
        remove_everything(wheelapp.app.amqp.delayed_settings)


if __name__ == "__main__":
    sys.exit(main())
