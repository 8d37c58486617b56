-- Claim the due tasks of one partition for the partition's current leader.
-- Redis' own clock (TIME) decides what is due, so poller clock skew cannot fire
-- tasks early or late. Claimed tasks move to the inflight set with a visibility
-- deadline; the poller removes them (ack.lua) once Kafka confirmed delivery.
-- Inflight tasks past their deadline (their claimer died) become due again.
--
-- KEYS[1] due ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] fence STRING
-- ARGV[1] fencing token (etcd create revision of the leader key)
-- ARGV[2] most tasks to claim   ARGV[3] visibility timeout ms
-- Returns {now_ms, next_due_ms or -1, id, due_ms, envelope, id, due_ms, envelope, ...};
-- fails with FENCED when a newer leader has claimed this partition.
local token = tonumber(ARGV[1])
local fence = tonumber(redis.call('GET', KEYS[4]) or '0')
if token < fence then
  return redis.error_reply('FENCED token ' .. ARGV[1] .. ' is older than ' .. fence)
end
if token > fence then redis.call('SET', KEYS[4], ARGV[1]) end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])

local expired = redis.call('ZRANGE', KEYS[3], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit)
for _, id in ipairs(expired) do
  redis.call('ZREM', KEYS[3], id)
  redis.call('ZADD', KEYS[1], now, id)
end

local out = {now, -1}
local deadline = now + tonumber(ARGV[3])
local due = redis.call('ZRANGE', KEYS[1], '-inf', now, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
for i = 1, #due, 2 do
  local id = due[i]
  redis.call('ZREM', KEYS[1], id)
  local envelope = redis.call('HGET', KEYS[2], id)
  if envelope then
    redis.call('ZADD', KEYS[3], deadline, id)
    out[#out + 1] = id
    out[#out + 1] = due[i + 1]
    out[#out + 1] = envelope
  end
end

local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
if head[2] then out[2] = tonumber(head[2]) end
return out
