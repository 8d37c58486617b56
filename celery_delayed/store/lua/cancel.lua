-- Cancel a scheduled task by id, removing its entry and message together.
-- A task already claimed by a poller is being dispatched and cannot be
-- cancelled here (the worker-side revoke covers it). The task's bucket and lane
-- are read from the head of its message; if it was the bucket's earliest, the
-- index gets the bucket's new earliest due time (or loses the emptied bucket).
-- Every key is read before the first write, and none is used once emptied: on a Redis
-- Cluster slot migration a key not on the node fails the script, and so only before it
-- changed anything (`gone`, _buckets.lua).
-- The removed envelope is also kept a while under the cancel's request id (KEYS[6]), so the
-- same request sent again after its reply was lost (DelayedStore.cancel_many) answers it
-- again rather than "unknown".
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] attempt HASH   KEYS[6] what this request removed: id -> envelope HASH   KEYS[7] failing ZSET (nack.lua)
-- ARGV[1] bucket key prefix   ARGV[2] task id   ARGV[3] ms KEYS[6] is kept
-- Returns the removed task's envelope (now or by this request before), 0 when unknown, -1 when in
-- flight (store.Change).
--- @include _buckets
local index, msgs, inflight, lanes, attempts, removed, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5],
  KEYS[6], KEYS[7]
local prefix, id = ARGV[1], ARGV[2]
local message = redis.call('HGET', msgs, id)
local before = redis.call('HGET', removed, id)  -- removed by this request sent before
if not message then return before or 0 end
if redis.call('ZSCORE', inflight, id) then return -1 end
take_from_bucket(lanes, index, prefix, id, message)
redis.call('HDEL', msgs, id)
redis.call('HDEL', attempts, id)
redis.call('ZREM', failing, id)
local envelope = envelope_of(message)
redis.call('HSET', removed, id, envelope)
redis.call('PEXPIRE', removed, ARGV[3])
return envelope
