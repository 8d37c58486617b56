-- Cancel a scheduled task by id, removing its entry and message together.
-- A task already claimed by a poller is being dispatched and cannot be
-- cancelled here (the worker-side revoke covers it). The task's bucket is read
-- from the first 4 bytes of its message; if it was the bucket's earliest, the
-- index gets the bucket's new earliest due time (or loses the emptied bucket).
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] attempt HASH
-- ARGV[1] bucket key prefix   ARGV[2] task id
-- Returns the removed task's envelope, 0 when unknown, -1 when in flight (store.Change).
local message = redis.call('HGET', KEYS[2], ARGV[2])
if not message then return 0 end
if redis.call('ZSCORE', KEYS[3], ARGV[2]) then return -1 end
local bucket = struct.unpack('>I4', message)
local key = ARGV[1] .. bucket
redis.call('ZREM', key, ARGV[2])
redis.call('HDEL', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
local rest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
if rest[2] then redis.call('ZADD', KEYS[1], rest[2], bucket) else redis.call('ZREM', KEYS[1], bucket) end
return string.sub(message, 5)
