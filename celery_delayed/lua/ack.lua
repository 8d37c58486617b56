-- Forget tasks that Kafka confirmed: drop them from inflight with their messages.
-- Only ids still in flight are removed, so an ack arriving after the visibility
-- deadline sent a task back to due cannot delete the pending copy.
--
-- KEYS[1] inflight ZSET   KEYS[2] msg HASH   ARGV task ids
-- Returns the number of tasks forgotten.
local n = 0
for _, id in ipairs(ARGV) do
  if redis.call('ZREM', KEYS[1], id) == 1 then
    redis.call('HDEL', KEYS[2], id)
    n = n + 1
  end
end
return n
