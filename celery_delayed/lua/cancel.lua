-- Cancel a scheduled task by id, removing its entry and message together.
-- A task already claimed by a poller is being dispatched and cannot be
-- cancelled here (the worker-side revoke covers it).
--
-- KEYS[1] due ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   ARGV[1] task id
-- Returns the removed task's envelope ('' if it had none), 0 when unknown,
-- -1 when already in flight.
if redis.call('ZREM', KEYS[1], ARGV[1]) == 1 then
  local envelope = redis.call('HGET', KEYS[2], ARGV[1])
  redis.call('HDEL', KEYS[2], ARGV[1])
  return envelope or ''
end
if redis.call('ZSCORE', KEYS[3], ARGV[1]) then return -1 end
return 0
