-- Schedule tasks in one partition. Each copy carries its attempt number (Celery's
-- `retries`); KEYS[4] keeps it for ids past their first attempt. What happens to
-- an id the store already holds:
--  * a newer attempt (a retry) replaces it, in flight or scheduled, moving to the
--    bucket of its own due time;
--  * the same attempt replaces a copy in flight (a put-back or requeue racing the
--    poller's ack), and the claim is dropped, so that copy's ack or nack (which
--    remove only what they claimed, see ack.lua) cannot delete the new one; a copy
--    still scheduled is kept (callers may safely retry);
--  * an older attempt (a late duplicate) never replaces anything;
--  * a new id leaves inflight if it is there without a message: a claim took it from
--    a bucket a partly applied schedule left behind (claim.lua), and that claim's
--    expiry would otherwise send this copy at once, whatever its due time.
-- Within one call, the first copy of an id wins.
-- Each task goes to the small sorted set of its time bucket in its lane (its queue,
-- see _buckets.lua); the lane's bucket index keeps each bucket's earliest due time
-- (ZADD LT), the lanes ZSET each lane's. The client sends every message already
-- behind its bucket start and lane (how cancel and reschedule find a task's bucket
-- from its id), so this script only reads them back. One ZADD per bucket and one
-- per lane for the indexes, whatever the number of tasks.
-- Every write that adds comes before any that removes, every bucket key a replacement
-- touches is read first, and no key is used once emptied: on a Redis Cluster slot
-- migration a key not on the node fails the script early, never leaving a task in no
-- bucket or in two (`gone`, _buckets.lua).
-- When a new task is due sooner than everything already in its lane, the pollers
-- are woken (PUBLISH) so they need not wait for their current sleep to end (a lane,
-- not the partition: the partition's earliest task may be in a paused lane).
--
-- KEYS[1] bucket index ZSET (bucket start s -> earliest due ms)   KEYS[2] msg HASH   KEYS[3] inflight ZSET
-- KEYS[4] lanes ZSET (lane -> earliest due ms)
-- KEYS[5] attempt HASH (id -> attempt number, for attempts after the first)
-- KEYS[6] failing ZSET (nack.lua): a replaced copy's entry goes with it
-- ARGV[1] wake channel   ARGV[2] bucket key prefix
-- then quads: task_id, due_ms, attempt, bucket start (4 bytes) + lane + envelope (at most 256: unpack() has limits)
-- Returns {added, replaced, kept}: new ids, ids whose stored copy was replaced, ids kept as stored.
--- @include _buckets
local index_key, msgs, inflight, lanes, attempts, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]
local channel, prefix = ARGV[1], ARGV[2]
local ids = {}
for i = 3, #ARGV, 4 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return {0, 0, 0} end
local stored = redis.call('HMGET', msgs, unpack(ids))
local seen, messages, buckets, order, earliest = {}, {}, {}, {}, nil
local superseded, moved, kept, numbered, fresh = {}, {}, 0, {}, {}
-- A message's head (bucket start and lane) -> {bucket key, lane, bucket start}: worked out
-- once per bucket, not once per task.
local places = {}
local function place(message)
  local head = string.sub(message, 1, string.byte(message, 5) == 0 and 6 + string.byte(message, 6) or 4)
  local found = places[head]
  if found == nil then
    found = {bucket_key_of(index_key, prefix, message), lane_of(message), bucket_of(message)}
    places[head] = found
  end
  return found
end
for n, id in ipairs(ids) do
  local due, attempt, message = ARGV[4 * n], tonumber(ARGV[4 * n + 1]), ARGV[4 * n + 2]
  local take = false
  if seen[id] then
    kept = kept + 1
  elseif not stored[n] then
    take = true
    fresh[#fresh + 1] = id
  else
    local held = tonumber(redis.call('HGET', attempts, id) or '0')
    local flying = redis.call('ZSCORE', inflight, id)
    if attempt > held or (attempt == held and flying) then
      take = true
      if flying then
        superseded[#superseded + 1] = id
      else
        moved[#moved + 1] = {id, stored[n], place(message)[1]}
      end
    else
      kept = kept + 1
    end
  end
  seen[id] = true
  if take then
    if attempt > 0 then
      numbered[#numbered + 1] = id
      numbered[#numbered + 1] = attempt
    end
    local where = place(message)
    local members = buckets[where[1]]
    if members == nil then
      members = {}
      buckets[where[1]] = members
      order[#order + 1] = where
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
for _, entry in ipairs(moved) do redis.call('EXISTS', bucket_key_of(index_key, prefix, entry[2])) end
local index, lane_order = {}, {}  -- per lane: its index entries; the lanes in first-seen order
for _, entry in ipairs(order) do
  local key, lane, bucket = entry[1], entry[2], entry[3]
  local members = buckets[key]
  local first = tonumber(members[1])
  for i = 3, #members, 2 do first = math.min(first, tonumber(members[i])) end
  local entries = index[lane]
  if entries == nil then
    entries = {first = first}
    index[lane] = entries
    lane_order[#lane_order + 1] = lane
  end
  entries[#entries + 1] = first
  entries[#entries + 1] = bucket
  entries.first = math.min(entries.first, first)
end
local wake = false
for _, lane in ipairs(lane_order) do
  local head = lane_head((lane_keys(index_key, prefix, lane)))
  wake = wake or head == nil or index[lane].first < head
end
for _, entry in ipairs(order) do redis.call('ZADD', entry[1], unpack(buckets[entry[1]])) end
for _, lane in ipairs(lane_order) do
  redis.call('ZADD', (lane_keys(index_key, prefix, lane)), 'LT', unpack(index[lane]))
  if lane ~= '' then redis.call('ZADD', lanes, 'LT', index[lane].first, lane) end
end
redis.call('HSET', msgs, unpack(messages))
if #numbered > 0 then redis.call('HSET', attempts, unpack(numbered)) end
for _, id in ipairs(superseded) do redis.call('ZREM', inflight, id) end
if #fresh > 0 then redis.call('ZREM', inflight, unpack(fresh)) end
-- a moved copy leaves its old bucket (unless its ZADD above just moved it within
-- it), and that bucket's index entry becomes its earliest remaining due time
for _, entry in ipairs(moved) do
  local id, old, new = entry[1], entry[2], entry[3]
  local lane, bucket = lane_of(old), bucket_of(old)
  local lane_index, lane_prefix = lane_keys(index_key, prefix, lane)
  if lane_prefix .. bucket ~= new then remove(lane_prefix .. bucket, id) end
  refresh_bucket(lanes, lane_index, lane_prefix .. bucket, bucket, lane)
end
local replaced = {unpack(superseded)}  -- none of them is failing now (nack.lua)
for _, entry in ipairs(moved) do replaced[#replaced + 1] = entry[1] end
if #replaced > 0 then redis.call('ZREM', failing, unpack(replaced)) end
if wake then redis.call('PUBLISH', channel, earliest) end
return {#messages / 2 - #superseded - #moved, #superseded + #moved, kept}
