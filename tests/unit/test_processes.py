"""tasks.processes: what a test or benchmark starts, it stops (by PID, its process group)."""
import subprocess
import time
from pathlib import Path

from tasks.processes import Processes


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_stop_all_also_stops_what_a_main_process_that_died_left_in_its_group(tmp_path):
    """A worker killed -9 leaves its pool children running; the next stop must not skip them."""
    main = subprocess.Popen(["sh", "-c", "sleep 300 & echo $!"], stdout=subprocess.PIPE, start_new_session=True)
    child = int(main.stdout.readline())
    main.wait()
    procs = Processes(tmp_path)
    procs.procs.append((main, tmp_path / "main.log"))
    assert _running(child)
    procs.stop_all(timeout=5)
    deadline = time.monotonic() + 10
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), f"pid {child}, left by a dead main process, still runs"
