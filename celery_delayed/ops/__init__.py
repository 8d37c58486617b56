"""What operators use: the ``celery delayed`` commands, the web view, browsing and draining the
schedule.

May import: every hop below it (store, client, poller, worker) and the shared modules.
"""
