"""The poller hop: one leader per partition (elected through etcd, fenced) claims what is due in
the store and publishes it to Kafka.

May import: the store, Kafka and the shared modules; never the client or the worker.
"""
