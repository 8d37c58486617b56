-- Return claimed tasks whose delivery failed to their partition, due again after
-- a short delay (by Redis' clock), so a Kafka outage delays tasks but loses none.
-- Only a copy still in flight under the claim that produced it moves (see
-- ack.lua): a newer copy scheduled meanwhile already stands on its own.
-- Each goes to the bucket of its new due time in its lane; its message records that bucket.
-- The bucket is written before the task leaves inflight: on a Redis Cluster slot
-- migration a bucket key (built here, not declared) can fail mid-script, and the
-- task must then still be in flight, to come back after its visibility timeout; inflight,
-- once emptied, is not read again (`gone`, _buckets.lua).
-- A task returned because its delivery failed is recorded as failing with the due time it had
-- then, kept through later failures (NX) until ack.lua, cancel.lua, reschedule.lua or a new copy
-- (schedule.lua) drops it: a nack moves its due time on, so `delayed status` counts the failing
-- ones by that first due time, not as overdue (Inspection.counts).
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] failing ZSET
-- ARGV[1] bucket key prefix   ARGV[2] bucket width s   ARGV[3] delay ms,
-- then triples: task id, claim stamp, the due ms it had when its delivery failed ('' when none did)
-- A copy claimed without a message (see claim.lua) just leaves inflight.
-- Returns the number of tasks returned.
--- @include _buckets
local index, msgs, inflight, lanes, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prefix, width, delay = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + delay
local bucket = bucket_for(due, width)
local n = 0
for i = 4, #ARGV, 3 do
  local id, stamp, failed = ARGV[i], tonumber(ARGV[i + 1]), ARGV[i + 2]
  local message = redis.call('HGET', msgs, id)
  local held = not gone[inflight] and tonumber(redis.call('ZSCORE', inflight, id)) == stamp  -- still this claim's copy
  if held and message then
    if failed ~= '' then redis.call('ZADD', failing, 'NX', failed, id) end
    put_in_bucket(lanes, index, msgs, prefix, bucket, id, due, message)
    n = n + 1
  end
  if held then remove(inflight, id) end  -- claimed without a message (claim.lua), it only leaves inflight
end
return n
