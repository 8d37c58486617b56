"""``celery delayed web``: a web view of the schedule and the dead letters (see :mod:`.server`)."""
