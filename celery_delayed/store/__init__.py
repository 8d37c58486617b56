"""The store hop: scheduled tasks in Redis -- key names, the Lua scripts, the layout, its reads,
durability checks, dead letters and the records of revoked tasks.

May import: the shared modules (settings, envelope) only; no hop above it, and never Kafka.
"""
