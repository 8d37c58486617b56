"""Every Lua script of celery-delayed, loaded by one glob from ``lua/``.

Each ``lua/<name>.lua`` is one atomic Redis operation whose header names its
KEYS, ARGV and replies; ``lua/_<steps>.lua`` files hold steps several scripts
share, pasted in where a script says ``--- @include _<steps>``.  A script is
registered once per client and called by SHA (see :class:`.redis_client.Script`).
"""
from __future__ import annotations

import functools
import re
from importlib import resources

import redis

from celery_delayed.store.redis_client import Script

_INCLUDE = re.compile(r"^--- @include (\w+)$", re.MULTILINE)
_LUA = resources.files(__package__) / "lua"
#: The scripts' names: every ``lua/*.lua`` but the shared steps (``_*.lua``).
NAMES = tuple(sorted(f.name[:-4] for f in _LUA.iterdir() if f.name.endswith(".lua") and not f.name.startswith("_")))


@functools.cache  # read once per process, however many clients register the scripts
def source(name: str) -> str:
    """The text of ``lua/<name>.lua``, each ``--- @include <steps>`` line replaced by ``lua/<steps>.lua``."""
    return _INCLUDE.sub(lambda line: _text(line[1]), _text(name))


def _text(name: str) -> str:
    return (_LUA / f"{name}.lua").read_text()


class Scripts:
    """Every script, registered on one client: ``scripts["claim"](keys=..., args=...)``."""

    def __init__(self, client: redis.Redis | redis.RedisCluster) -> None:
        self._scripts = {name: Script(client, source(name)) for name in NAMES}

    def __getitem__(self, name: str) -> Script:
        return self._scripts[name]
