-- Move a scheduled task to a new due time, and so to the bucket of that time in
-- its lane (the old bucket's index entry is refreshed as in cancel.lua). A task already
-- claimed by a poller is being dispatched and cannot be moved; neither can an
-- unknown id. When the task is due before anything its lane held, the pollers are
-- woken (PUBLISH, as in schedule.lua).
-- Every key is read before the first write, and none is used once emptied (the task enters
-- its new bucket before it leaves the old one): on a Redis Cluster slot migration a key not
-- on the node fails the script, and so only before it changed anything (`gone`, _buckets.lua).
--
-- A task moved is no longer counted as failing (nack.lua) from its old due time.
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] failing ZSET
-- ARGV[1] wake channel   ARGV[2] bucket key prefix   ARGV[3] bucket width s
-- ARGV[4] task id   ARGV[5] new due ms
-- Returns 1 when moved, 0 when unknown, -1 when in flight (store.Change).
--- @include _buckets
local index, msgs, inflight, lanes, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local channel, prefix, width, id, due = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[5])
local message = redis.call('HGET', msgs, id)
if not message then return 0 end
if redis.call('ZSCORE', inflight, id) then return -1 end
local bucket = bucket_for(due, width)
local lane, old = lane_of(message), bucket_of(message)
local lane_index, lane_prefix = lane_keys(index, prefix, lane)
local head = lane_head(lane_index)
redis.call('EXISTS', lane_prefix .. old, lane_prefix .. bucket)
put_in_bucket(lanes, index, msgs, prefix, bucket, id, due, message)
if bucket ~= old then remove(lane_prefix .. old, id) end
refresh_bucket(lanes, lane_index, lane_prefix .. old, old, lane)
redis.call('ZREM', failing, id)
if head == nil or due < head then redis.call('PUBLISH', channel, due) end
return 1
