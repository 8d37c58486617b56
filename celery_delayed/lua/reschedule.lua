-- Move a scheduled task to a new due time, and so to the bucket of that time
-- (the old bucket's index entry is refreshed as in cancel.lua). A task already
-- claimed by a poller is being dispatched and cannot be moved; neither can an
-- unknown id. When the task becomes the partition's earliest, the pollers are
-- woken (PUBLISH).
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET
-- ARGV[1] wake channel   ARGV[2] bucket key prefix   ARGV[3] bucket width s
-- ARGV[4] task id   ARGV[5] new due ms
-- Returns 1 when moved, 0 when unknown, -1 when in flight (store.Change).
local id, due, width = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[3])
local message = redis.call('HGET', KEYS[2], id)
if not message then return 0 end
if redis.call('ZSCORE', KEYS[3], id) then return -1 end
local old = struct.unpack('>I4', message)
local key = ARGV[2] .. old
local bucket = math.floor(due / 1000 / width) * width
-- read both bucket keys before any write: on a Redis Cluster slot migration an
-- undeclared key fails here, with nothing changed yet
redis.call('EXISTS', key)
redis.call('EXISTS', ARGV[2] .. bucket)
redis.call('ZREM', key, id)
local rest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
if rest[2] then redis.call('ZADD', KEYS[1], rest[2], old) else redis.call('ZREM', KEYS[1], old) end

local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
redis.call('ZADD', ARGV[2] .. bucket, due, id)
redis.call('ZADD', KEYS[1], 'LT', due, bucket)
redis.call('HSET', KEYS[2], id, struct.pack('>I4', bucket) .. string.sub(message, 5))
if head[2] == nil or due < tonumber(head[2]) then
  redis.call('PUBLISH', ARGV[1], due)
end
return 1
