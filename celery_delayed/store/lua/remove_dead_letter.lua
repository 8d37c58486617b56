-- Remove one dead letter: its record and its index entry together.
-- With ARGV[2], only while the record is still exactly those bytes, so a requeue
-- never deletes a newer failure of the same task parked in the meantime.
--
-- KEYS[1] dead-letter HASH   KEYS[2] index ZSET   ARGV[1] task id   ARGV[2] expected record (optional)
-- Returns 1 when a record was removed, 0 when there was none or it was replaced.
local letters, index = KEYS[1], KEYS[2]
local task_id, expected = ARGV[1], ARGV[2]
local record = redis.call('HGET', letters, task_id)
if record and expected and record ~= expected then return 0 end
redis.call('ZREM', index, task_id)
return redis.call('HDEL', letters, task_id)
