-- Take the run claim of a task id for this worker, unless the task was revoked
-- or has already finished (once.py: remember_finished). The keys carry the task
-- id as hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] run claim key   KEYS[2] revoke record key   KEYS[3] finished record key
-- ARGV[1] owner   ARGV[2] lease ms
-- Returns 0 when claimed, -1 when the task was revoked, -2 when it finished,
-- else the ms until the current holder's claim expires.
if redis.call('EXISTS', KEYS[2]) == 1 then return -1 end
if redis.call('EXISTS', KEYS[3]) == 1 then return -2 end
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
return math.max(1, redis.call('PTTL', KEYS[1]))
