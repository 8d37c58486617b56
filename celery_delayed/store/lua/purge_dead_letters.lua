-- Empty the dead-letter queue. UNLINK frees the two (possibly big) keys in the
-- background, so Redis does not stall while a large queue is dropped.
--
-- KEYS[1] dead-letter HASH   KEYS[2] index ZSET
-- Returns how many dead letters there were.
local letters, index = KEYS[1], KEYS[2]
local n = redis.call('ZCARD', index)
redis.call('UNLINK', letters, index)
return n
