-- Schedule tasks in one partition. A task id that is already scheduled (due or
-- in flight) keeps its entry untouched, so callers may safely retry.
-- When a new task is due sooner than everything already there, the pollers are
-- woken (PUBLISH) so they need not wait for their current sleep to end.
--
-- KEYS[1] due ZSET (task_id -> due ms)   KEYS[2] msg HASH (task_id -> envelope)
-- ARGV[1] wake channel, then triples: task_id, due_ms, envelope
-- Returns the number of tasks added.
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local earliest = nil
local added = 0
for i = 2, #ARGV, 3 do
  if redis.call('HSETNX', KEYS[2], ARGV[i], ARGV[i + 2]) == 1 then
    local due = tonumber(ARGV[i + 1])
    redis.call('ZADD', KEYS[1], due, ARGV[i])
    added = added + 1
    if earliest == nil or due < earliest then earliest = due end
  end
end
if earliest ~= nil and (head[2] == nil or earliest < tonumber(head[2])) then
  redis.call('PUBLISH', ARGV[1], earliest)
end
return added
