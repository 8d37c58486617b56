-- Forget tasks that Kafka confirmed: drop them from inflight with their messages.
-- Only a copy still in flight under the claim that produced it is removed: a
-- newer copy scheduled meanwhile (a retry, a put-back: schedule.lua drops the
-- claim) or a later claim of the id (after the visibility deadline sent it back
-- to due) has another stamp, and stays.
--
-- KEYS[1] inflight ZSET   KEYS[2] msg HASH   KEYS[3] attempt HASH (see schedule.lua)
-- ARGV pairs: task id, claim stamp (the deadline claim.lua gave it)
-- Returns the number of tasks forgotten.
local inflight, msgs, attempts = KEYS[1], KEYS[2], KEYS[3]
local n = 0
for i = 1, #ARGV, 2 do
  local id, stamp = ARGV[i], tonumber(ARGV[i + 1])
  if tonumber(redis.call('ZSCORE', inflight, id)) == stamp then
    redis.call('ZREM', inflight, id)
    redis.call('HDEL', msgs, id)
    redis.call('HDEL', attempts, id)
    n = n + 1
  end
end
return n
