-- Park a message in the dead-letter queue with why it failed. Writing the same
-- task id again replaces its record (the latest failure wins) but keeps one entry.
--
-- KEYS[1] dead-letter HASH (task_id -> record)   KEYS[2] index ZSET (task_id -> ms)
-- ARGV[1] task id   ARGV[2] record
-- Returns 1 when the task id was new to the queue, 0 when it replaced a record.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now, ARGV[1])
return redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
