"""Text from the store made inert for a terminal or a log line.

Task ids, task names, queue names, arguments and dead-letter reasons are written
by whoever schedules a task, often from end-user input.  Written raw, an ESC
sequence in one retitles or clears the operator's terminal or plants a link,
and a CR/LF forges a log line; :func:`inert` shows such characters escaped, as
``repr`` does, and leaves every other character as it is.
"""
from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

#: C0 controls, DEL, C1 controls and the Unicode bidi overrides and isolates (they reorder what follows).
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def inert(text: str) -> str:
    """``text`` with each control or bidi character shown escaped (``\\x1b``, ``\\n``, ``\\u202e``)."""
    return _UNSAFE.sub(lambda match: repr(match.group())[1:-1], text)


class _Inert:
    """A log argument formatted inert by ``%s`` and ``%r`` alike."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __str__(self) -> str:
        return inert(str(self.value))

    def __repr__(self) -> str:
        return inert(repr(self.value))


class InertArgs(logging.Filter):
    """Formats a record's arguments inert, positional or by name (numbers kept as they are, for ``%d``):
    a task id or a reason holding CR/LF cannot forge a log line; messages of plain arguments look as before."""

    def filter(self, record: logging.LogRecord) -> bool:
        if isinstance(record.args, tuple):
            record.args = tuple(_kept(a) for a in record.args)
        elif isinstance(record.args, Mapping):  # Celery's own: "Task %(name)s[%(id)s] received"
            record.args = {key: _kept(value) for key, value in record.args.items()}
        return True


def _kept(value: Any) -> Any:
    return value if isinstance(value, (int, float)) else _Inert(value)


_FILTER = InertArgs()


def guard_handlers(logger: logging.Logger | None = None, **_: Any) -> None:
    """Make every record written through ``logger``'s handlers inert, Celery's own lines too (a worker's
    "Task name[id] received" names an id a scheduler chose): a receiver of Celery's
    ``after_setup_logger`` and ``after_setup_task_logger``."""
    for handler in logger.handlers if logger is not None else ():
        if _FILTER not in handler.filters:
            handler.addFilter(_FILTER)


def logger(name: str) -> logging.Logger:
    """``logging.getLogger(name)``, its records' arguments formatted inert (a logger's filter applies to
    its own records only, so each module's logger gets it)."""
    log = logging.getLogger(name)
    log.addFilter(_FILTER)
    return log
