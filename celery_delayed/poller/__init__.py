"""The poller hop: one leader per partition (elected through etcd, fenced) claims what is due in
the store and publishes it to Kafka, writing each recurring schedule's next occurrence as it goes.

May import: recurring, the store, Kafka and the shared modules; never the client or the worker.
"""
