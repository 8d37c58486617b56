import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the demo project (tasks/, config/) lives at the root
    sys.path.insert(0, str(ROOT))


def pytest_sessionstart(session):
    """Print the machine and every version the run uses, also under -q (constraints.txt records
    the tested ones)."""
    from bench.common import versions
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line("versions: " + ", ".join(f"{name} {version}" for name, version in versions().items()))
