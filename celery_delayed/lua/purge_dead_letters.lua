-- Empty the dead-letter queue. UNLINK frees the two (possibly big) keys in the
-- background, so Redis does not stall while a large queue is dropped.
--
-- KEYS[1] dead-letter HASH   KEYS[2] index ZSET
-- Returns how many dead letters there were.
local n = redis.call('ZCARD', KEYS[2])
redis.call('UNLINK', KEYS[1], KEYS[2])
return n
