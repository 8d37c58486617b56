-- Cancel a scheduled task by id, removing its entry and message together.
-- A task already claimed by a poller is being dispatched and cannot be
-- cancelled here (the worker-side revoke covers it). The task's bucket and lane
-- are read from the head of its message; if it was the bucket's earliest, the
-- index gets the bucket's new earliest due time (or loses the emptied bucket).
-- Every key is read before the first write, and none is used once emptied: on a Redis
-- Cluster slot migration a key not on the node fails the script, and so only before it
-- changed anything (`gone`, _buckets.lua).
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] attempt HASH
-- ARGV[1] bucket key prefix   ARGV[2] task id
-- Returns the removed task's envelope, 0 when unknown, -1 when in flight (store.Change).
--- @include _buckets
local index, msgs, inflight, lanes, attempts = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prefix, id = ARGV[1], ARGV[2]
local message = redis.call('HGET', msgs, id)
if not message then return 0 end
if redis.call('ZSCORE', inflight, id) then return -1 end
take_from_bucket(lanes, index, prefix, id, message)
redis.call('HDEL', msgs, id)
redis.call('HDEL', attempts, id)
return envelope_of(message)
