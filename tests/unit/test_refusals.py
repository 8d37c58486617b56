"""Which Redis errors mean the store refuses commands whatever they are (a store error), and which a wrong command."""
from __future__ import annotations

import pytest
import redis
from redis._parsers.base import BaseParser

from celery_delayed.store.redis_client import REFUSALS, refusal


@pytest.mark.parametrize("reply", [
    "OOM command not allowed when used memory > 'maxmemory'.",
    "READONLY You can't write against a read only replica.",
    "NOPERM User default has no permissions to run the 'set' command",
    "MISCONF Redis is configured to save RDB snapshots, but it's currently unable to persist to disk.",
    "NOREPLICAS Not enough good replicas to write.",
    "BUSY Redis is busy running a script.",
])
def test_a_refusal_is_named_with_what_it_means_and_redis_own_words_also_from_a_pipeline(reply):
    code = reply.split(" ", 1)[0]
    assert refusal(BaseParser.parse_error(reply)) == f"{REFUSALS[code]}: {reply}"
    piped = BaseParser.parse_error(reply)  # as redis-py's pipeline annotates it
    piped.args = (f"Command # 1 (SET k v NX) of pipeline caused error: {piped.args[0]}",)
    assert refusal(piped) == f"{REFUSALS[code]}: {reply}"


def test_an_acl_refusal_inside_a_script_is_one_too():
    said = "The user executing the script can't run this command or subcommand script: 1021d5, on @user_script:105."
    assert refusal(BaseParser.parse_error(f"ERR {said}")) == f"{REFUSALS['NOPERM']}: NOPERM {said}"


@pytest.mark.parametrize("reply", ["WRONGTYPE Operation against a key holding the wrong kind of value",
                                   "ERR FENCED partition 3", "NOSCRIPT No matching script."])
def test_a_wrong_command_is_no_refusal(reply):
    error = BaseParser.parse_error(reply)
    assert isinstance(error, redis.ResponseError) and refusal(error) is None
