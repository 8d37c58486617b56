-- Forget tasks that Kafka confirmed: drop them from inflight with their messages.
-- Only a copy still in flight under the claim that produced it is removed: a
-- newer copy scheduled meanwhile (a retry, a put-back: schedule.lua drops the
-- claim) or a later claim of the id (after the visibility deadline sent it back
-- to due) has another stamp, and stays.
--
-- A delivered task is no longer failing (nack.lua).
--
-- KEYS[1] inflight ZSET   KEYS[2] msg HASH   KEYS[3] attempt HASH (see schedule.lua)   KEYS[4] failing ZSET
-- ARGV pairs: task id, claim stamp (the deadline claim.lua gave it)
-- Returns the number of tasks forgotten.
local inflight, msgs, attempts, failing = KEYS[1], KEYS[2], KEYS[3], KEYS[4]
local ids = {}
for i = 1, #ARGV, 2 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local stamps = redis.call('ZMSCORE', inflight, unpack(ids))
local done = {}
for j, id in ipairs(ids) do
  if tonumber(stamps[j]) == tonumber(ARGV[2 * j]) then done[#done + 1] = id end
end
if #done == 0 then return 0 end
redis.call('ZREM', inflight, unpack(done))
redis.call('HDEL', msgs, unpack(done))
redis.call('HDEL', attempts, unpack(done))
redis.call('ZREM', failing, unpack(done))
return #done
