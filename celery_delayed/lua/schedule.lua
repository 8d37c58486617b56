-- Schedule tasks in one partition. What happens to an id the store already holds:
--  * in flight (a poller claimed it): the new copy replaces it and the claim is
--    dropped, so the old copy's ack or nack (which remove only what they claimed,
--    see ack.lua) cannot delete the new one: a retry or put-back racing the
--    poller's ack always lands;
--  * scheduled, and ARGV[3] is 'replace' (a retry: a newer attempt): the new copy
--    replaces it, moving to the bucket of its own due time;
--  * scheduled, otherwise: the stored copy is kept (callers may safely retry).
-- Within one call, the first copy of an id wins.
-- Each task goes to the small sorted set of its time bucket; the bucket index
-- keeps each bucket's earliest due time (ZADD LT). The client sends every
-- message already behind its 4-byte bucket start (how cancel and reschedule
-- find a task's bucket from its id), so this script only reads it back. One
-- ZADD per bucket and one for the index, whatever the number of tasks.
-- Every write that adds comes before any that removes, and every bucket key a
-- replacement touches is read first: on a Redis Cluster slot migration an
-- undeclared key fails the script early, never leaving a task in no bucket.
-- When a new task is due sooner than everything already there, the pollers are
-- woken (PUBLISH) so they need not wait for their current sleep to end.
--
-- KEYS[1] bucket index ZSET (bucket start s -> earliest due ms)   KEYS[2] msg HASH   KEYS[3] inflight ZSET
-- ARGV[1] wake channel   ARGV[2] bucket key prefix   ARGV[3] 'replace' or 'keep'
-- then triples: task_id, due_ms, bucket start (4 bytes) + envelope (at most 256: unpack() has limits)
-- Returns {added, replaced, kept}: new ids, ids whose stored copy was replaced, ids kept as stored.
local index_key, msgs, inflight = KEYS[1], KEYS[2], KEYS[3]
local channel, prefix, replace = ARGV[1], ARGV[2], ARGV[3] == 'replace'
local ids = {}
for i = 4, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return {0, 0, 0} end
local stored = redis.call('HMGET', msgs, unpack(ids))
local seen, messages, buckets, order, earliest = {}, {}, {}, {}, nil
local superseded, moved, kept = {}, {}, 0
for n, id in ipairs(ids) do
  local take = false
  if seen[id] then
    kept = kept + 1
  elseif not stored[n] then
    take = true
  elseif redis.call('ZSCORE', inflight, id) then
    take = true
    superseded[#superseded + 1] = id
  elseif replace then
    take = true
    moved[#moved + 1] = {id, struct.unpack('>I4', stored[n]), struct.unpack('>I4', ARGV[3 * n + 3])}
  else
    kept = kept + 1
  end
  seen[id] = true
  if take then
    local due, message = ARGV[3 * n + 2], ARGV[3 * n + 3]
    local bucket = struct.unpack('>I4', message)
    local members = buckets[bucket]
    if members == nil then
      members = {}
      buckets[bucket] = members
      order[#order + 1] = bucket
    end
    members[#members + 1] = due
    members[#members + 1] = id
    messages[#messages + 1] = id
    messages[#messages + 1] = message
    due = tonumber(due)
    if earliest == nil or due < earliest then earliest = due end
  end
end
if earliest == nil then return {0, 0, kept} end
for _, entry in ipairs(moved) do redis.call('EXISTS', prefix .. entry[2]) end
local head = redis.call('ZRANGE', index_key, 0, 0, 'WITHSCORES')
local index = {}
for _, bucket in ipairs(order) do
  local members = buckets[bucket]
  redis.call('ZADD', prefix .. bucket, unpack(members))
  local first = tonumber(members[1])
  for i = 3, #members, 2 do first = math.min(first, tonumber(members[i])) end
  index[#index + 1] = first
  index[#index + 1] = bucket
end
redis.call('ZADD', index_key, 'LT', unpack(index))
redis.call('HSET', msgs, unpack(messages))
for _, id in ipairs(superseded) do redis.call('ZREM', inflight, id) end
-- a moved copy leaves its old bucket (unless its ZADD above just moved it within
-- it), and that bucket's index entry becomes its earliest remaining due time
for _, entry in ipairs(moved) do
  local id, old, new = entry[1], entry[2], entry[3]
  if old ~= new then redis.call('ZREM', prefix .. old, id) end
  local rest = redis.call('ZRANGE', prefix .. old, 0, 0, 'WITHSCORES')
  if rest[2] then redis.call('ZADD', index_key, rest[2], old) else redis.call('ZREM', index_key, old) end
end
if head[2] == nil or earliest < tonumber(head[2]) then
  redis.call('PUBLISH', channel, earliest)
end
return {#messages / 2 - #superseded - #moved, #superseded + #moved, kept}
