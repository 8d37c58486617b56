-- Park a message in the dead-letter queue with why it failed, then trim the queue
-- to its retention. Writing the same task id again replaces its record (the latest
-- failure wins) but keeps one entry. Trimming drops the oldest letters: those parked
-- more than max age ago, and those beyond max entries; at most `trim limit` per call,
-- so a call stays short and a queue over its limits converges as letters arrive.
--
-- KEYS[1] dead-letter HASH (task_id -> record)   KEYS[2] index ZSET (task_id -> ms)
-- ARGV[1] task id   ARGV[2] record   ARGV[3] max age ms (0 = none)
-- ARGV[4] max entries (0 = none)   ARGV[5] trim limit
-- Returns {1 when the task id was new to the queue else 0, letters trimmed}.
local letters, index = KEYS[1], KEYS[2]
local task_id, record = ARGV[1], ARGV[2]
local max_age, max_entries, limit = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', index, now, task_id)
local new = redis.call('HSET', letters, task_id, record)

local old = {}
if max_age > 0 then
  old = redis.call('ZRANGE', index, '-inf', '(' .. (now - max_age), 'BYSCORE', 'LIMIT', 0, limit)
end
if max_entries > 0 then
  local over = redis.call('ZCARD', index) - #old - max_entries
  if over > 0 and #old < limit then
    old = redis.call('ZRANGE', index, 0, #old + math.min(over, limit - #old) - 1)
  end
end
if #old > 0 then
  redis.call('ZREM', index, unpack(old))
  redis.call('HDEL', letters, unpack(old))
end
return {new, #old}
