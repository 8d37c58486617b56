-- Return claimed tasks whose delivery failed to the due set, due again after a
-- short delay (by Redis' clock), so a Kafka outage delays tasks but loses none.
--
-- KEYS[1] inflight ZSET   KEYS[2] due ZSET   ARGV[1] delay ms, then task ids
-- Returns the number of tasks returned.
local t = redis.call('TIME')
local due = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000) + tonumber(ARGV[1])
local n = 0
for i = 2, #ARGV do
  if redis.call('ZREM', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], due, ARGV[i])
    n = n + 1
  end
end
return n
