-- Count one partition's tasks for `delayed status` and the metrics: how many
-- are scheduled, in flight and overdue (due by Redis' clock, still waiting),
-- the earliest due time, and the earliest due time still to come. Only buckets
-- whose earliest task is overdue are looked into, one call each: a bucket that
-- ended before now is overdue whole; only the one holding now is split.
-- Also the tasks whose delivery failed and that are not delivered yet (nack.lua): a nack
-- makes them due again shortly, so only their first failed due time shows how late they are.
-- A failing task whose message is gone has left the store by a way that did not drop it from
-- `failing` (the ack of a poller of an earlier release, during a rolling upgrade): up to
-- PRUNE_FAILING of the oldest are looked at each call, and those are dropped, not counted.
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] failing ZSET
-- ARGV[1] bucket key prefix   ARGV[2] now ms   ARGV[3] bucket width s
-- Writes: removes from `failing` the task ids it holds whose message is gone.
-- Returns {scheduled, inflight, overdue, next_due_ms or -1, upcoming_due_ms or -1, failing,
-- earliest failed due ms or -1}, then per lane holding tasks: lane, its overdue tasks, its earliest due ms.
--- @include _buckets
local index, msgs, inflight_key, lanes, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]
local prefix, now, width = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local current = math.floor(now / 1000 / width) * width
local inflight = redis.call('ZCARD', inflight_key)
local overdue, upcoming, per_lane = 0, nil, {}
local function sooner(due)
  if due and (upcoming == nil or tonumber(due) < upcoming) then upcoming = tonumber(due) end
end
for _, lane in ipairs(all_lanes(lanes)) do
  local lane_index, lane_prefix = lane_keys(index, prefix, lane)
  local late = 0
  for _, b in ipairs(redis.call('ZRANGE', lane_index, '-inf', now, 'BYSCORE')) do
    local key = lane_prefix .. b
    if tonumber(b) < current then
      late = late + redis.call('ZCARD', key)
    else
      late = late + redis.call('ZCOUNT', key, '-inf', now)
      sooner(redis.call('ZRANGE', key, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')[2])
    end
  end
  sooner(redis.call('ZRANGE', lane_index, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')[2])
  overdue = overdue + late
  local head = lane_head(lane_index)
  if head then
    per_lane[#per_lane + 1] = lane
    per_lane[#per_lane + 1] = late
    per_lane[#per_lane + 1] = head
  end
end
local PRUNE_FAILING = 1000
local failed_first, oldest = nil, redis.call('ZRANGE', failing, 0, PRUNE_FAILING - 1, 'WITHSCORES')
for i = 1, #oldest, 2 do
  if redis.call('HEXISTS', msgs, oldest[i]) == 0 then
    redis.call('ZREM', failing, oldest[i])
  elseif failed_first == nil then
    failed_first = oldest[i + 1]
  end
end
local out = {redis.call('HLEN', msgs) - inflight, inflight, overdue, earliest_due(lanes, index) or -1, upcoming or -1,
             redis.call('ZCARD', failing), failed_first and tonumber(failed_first) or -1}
for _, value in ipairs(per_lane) do out[#out + 1] = value end
return out
