"""Wall clocks a chaos fault can step: each poller and worker of the run under libfaketime, its
monotonic clock left real (``FAKETIME_DONT_FAKE_MONOTONIC``), its wall clock offset by what its own
file says (``FAKETIME_TIMESTAMP_FILE``, read again every second): ``+0`` until a fault writes ``+30s``.

libfaketime 0.9.10 (Debian 12) mistimes the waits on a real monotonic clock: :data:`REAL_WAITS`, built
here with the C compiler, is preloaded before it and gives those waits to glibc (see its header).

The ledger's times are not the stepped clock's: :mod:`tasks.chaos` reads the wall clock as the machine's
monotonic clock, which libfaketime leaves alone, plus the difference the runner measured
(:func:`share_wall_clock`).  Needs Debian's faketime and a C compiler (``scripts/services network``).
"""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import time
from pathlib import Path

from tasks.chaos import WALL_MINUS_MONOTONIC

#: The source of the library preloaded before libfaketime (waits on the real monotonic clock, see its header).
REAL_WAITS = Path(__file__).resolve().parent / "realwaits.c"


def library() -> str | None:
    """Path of libfaketime, or None when it is not installed."""
    found = sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1"))
    return found[0] if found else None


def available() -> str | None:
    """Why the clocks cannot be stepped here, or None when they can."""
    missing = [what for what, found in (("libfaketime", library()), ("a C compiler (cc)", shutil.which("cc")))
               if not found]
    return f"{' and '.join(missing)} missing (scripts/services network installs them)" if missing else None


def share_wall_clock() -> None:
    """Give the processes this run starts the runner's wall clock (see the module docstring)."""
    os.environ[WALL_MINUS_MONOTONIC] = repr(time.time() - time.monotonic())


class Clocks:
    """The faked clocks of a run's processes, one offset file each (in ``folder``)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.made = 0
        real_waits = folder / "realwaits.so"
        subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(real_waits), str(REAL_WAITS), "-ldl"],
                       check=True, capture_output=True)
        self.preload = f"{real_waits} {library()}"

    def wrap(self) -> tuple[list[str], Path]:
        """The command prefix that starts a program under a clock of its own (``+0`` for now), and its file."""
        self.made += 1
        offset = self.folder / f"clock-{self.made}"
        offset.write_text("+0\n")
        return ["env", f"LD_PRELOAD={self.preload}", f"FAKETIME_TIMESTAMP_FILE={offset}", "FAKETIME_CACHE_DURATION=1",
                "FAKETIME_DONT_FAKE_MONOTONIC=1"], offset


def step(offset: Path, seconds: int) -> None:
    """Set the wall clock of the process behind ``offset`` to ``seconds`` off the real one (0: back)."""
    offset.write_text(f"{seconds:+d}s\n" if seconds else "+0\n")
