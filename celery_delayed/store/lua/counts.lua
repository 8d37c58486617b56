-- Count one partition's tasks for `delayed status` and the metrics: how many
-- are scheduled, in flight and overdue (due by Redis' clock, still waiting),
-- the earliest due time, and the earliest due time still to come. Only buckets
-- whose earliest task is overdue are looked into, one call each: a bucket that
-- ended before now is overdue whole; only the one holding now is split.
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET
-- ARGV[1] bucket key prefix   ARGV[2] now ms   ARGV[3] bucket width s
-- Returns {scheduled, inflight, overdue, next_due_ms or -1, upcoming_due_ms or -1}.
local index, msgs, inflight_key = KEYS[1], KEYS[2], KEYS[3]
local prefix, now, width = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
local current = math.floor(now / 1000 / width) * width
local inflight = redis.call('ZCARD', inflight_key)
local overdue, upcoming = 0, nil
for _, b in ipairs(redis.call('ZRANGE', index, '-inf', now, 'BYSCORE')) do
  local key = prefix .. b
  if tonumber(b) < current then
    overdue = overdue + redis.call('ZCARD', key)
  else
    overdue = overdue + redis.call('ZCOUNT', key, '-inf', now)
    local later = redis.call('ZRANGE', key, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
    if later[2] then upcoming = tonumber(later[2]) end
  end
end
local next_bucket = redis.call('ZRANGE', index, '(' .. now, '+inf', 'BYSCORE', 'LIMIT', 0, 1, 'WITHSCORES')
if next_bucket[2] and (upcoming == nil or tonumber(next_bucket[2]) < upcoming) then
  upcoming = tonumber(next_bucket[2])
end
local head = redis.call('ZRANGE', index, 0, 0, 'WITHSCORES')
return {redis.call('HLEN', msgs) - inflight, inflight, overdue, head[2] and tonumber(head[2]) or -1, upcoming or -1}
