-- Move a scheduled task to a new due time. A task already claimed by a poller
-- is being dispatched and cannot be moved; neither can an unknown id. When the
-- task becomes the partition's earliest, the pollers are woken (PUBLISH).
--
-- KEYS[1] due ZSET   KEYS[2] inflight ZSET
-- ARGV[1] wake channel   ARGV[2] task id   ARGV[3] new due ms
-- Returns 1 when moved, 0 when unknown, -1 when in flight.
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then
  redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[2])
  if redis.call('ZRANGE', KEYS[1], 0, 0)[1] == ARGV[2] then
    redis.call('PUBLISH', ARGV[1], ARGV[3])
  end
  return 1
end
if redis.call('ZSCORE', KEYS[2], ARGV[2]) then return -1 end
return 0
