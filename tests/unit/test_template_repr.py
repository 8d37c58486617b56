"""client/template.py writes ``argsrepr``/``kwargsrepr`` by plain ``repr`` where it equals Celery's ``saferepr``."""
import random

from celery.utils.saferepr import saferepr

from celery_delayed.client.template import argsrepr


def test_argsrepr_is_what_celery_writes():
    rng = random.Random(44)
    values = [0, -1, 10**30, 1.5, float("inf"), float("nan"), -0.0, True, False, None, "", "plain", "it's",
              'say "hi"', "back\\slash", "tab\tand\nnewline", "naïve", "☃", "x" * 63, "x" * 64, "x" * 2000,
              b"bytes", [1, 2], (1,), {"a": 1}, {1: 2}, set(), object]
    for _ in range(20_000):
        items = [rng.choice(values) for _ in range(rng.randrange(6))]
        args = tuple(items) if rng.random() < 0.7 else items
        kwargs = {rng.choice(["a", "user_id", "größe", "with space", "1st"]): v for v in items}
        for value, maxsize in ((args, 1024), (kwargs, 1024), (args, 16), (kwargs, 40)):
            assert argsrepr(value, maxsize, 3) == saferepr(value, maxsize, maxlevels=3), value


def test_task_ids_made_at_once_are_uuid4s_as_celery_writes_them():
    import uuid

    from celery_delayed.client.template import _random_ids

    ids = list(_random_ids(5000))
    assert len(set(ids)) == 5000
    for task_id in ids:
        parsed = uuid.UUID(task_id)
        assert (str(parsed), parsed.version, parsed.variant) == (task_id, 4, uuid.RFC_4122)
