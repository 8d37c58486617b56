-- Remove one dead letter: its record and its index entry together.
-- With ARGV[2], only while the record is still exactly those bytes, so a requeue
-- never deletes a newer failure of the same task parked in the meantime.
--
-- KEYS[1] dead-letter HASH   KEYS[2] index ZSET   ARGV[1] task id   ARGV[2] expected record (optional)
-- Returns 1 when a record was removed, 0 when there was none or it was replaced.
local record = redis.call('HGET', KEYS[1], ARGV[1])
if record and ARGV[2] and record ~= ARGV[2] then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
return redis.call('HDEL', KEYS[1], ARGV[1])
