"""What operators use: the ``celery delayed`` commands, the web view, browsing and draining the
schedule.

May import: every hop below it (client, poller, worker, recurring, store) and the shared modules.
"""
