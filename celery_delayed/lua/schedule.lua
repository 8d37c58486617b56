-- Schedule tasks in one partition. A task id that is already scheduled (due or
-- in flight) keeps its entry untouched, so callers may safely retry; within one
-- call, the first copy of an id wins.
-- One variadic HMGET, HSET and ZADD rather than commands per task (callers send
-- at most 500 triples, well under Lua's unpack() limit).
-- When a new task is due sooner than everything already there, the pollers are
-- woken (PUBLISH) so they need not wait for their current sleep to end.
--
-- KEYS[1] due ZSET (task_id -> due ms)   KEYS[2] msg HASH (task_id -> envelope)
-- ARGV[1] wake channel, then triples: task_id, due_ms, envelope
-- Returns the number of tasks added.
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local ids = {}
for i = 2, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local stored = redis.call('HMGET', KEYS[2], unpack(ids))
local seen, messages, scored, earliest = {}, {}, {}, nil
for n, id in ipairs(ids) do
  if not stored[n] and not seen[id] then
    seen[id] = true
    local due = ARGV[3 * n]
    messages[#messages + 1] = id
    messages[#messages + 1] = ARGV[3 * n + 1]
    scored[#scored + 1] = due
    scored[#scored + 1] = id
    if earliest == nil or tonumber(due) < earliest then earliest = tonumber(due) end
  end
end
if #scored == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(messages))
redis.call('ZADD', KEYS[1], unpack(scored))
if head[2] == nil or earliest < tonumber(head[2]) then
  redis.call('PUBLISH', ARGV[1], earliest)
end
return #scored / 2
