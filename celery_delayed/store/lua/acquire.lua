-- Take the run claim of a task id for this worker, unless the task was revoked
-- or this attempt of it has already ended (once.py: remember_finished). The
-- finished record holds 'F' once the task ended for good, else the attempt
-- number (once.attempt_of: Celery's `retries`, past every attempt of the task a
-- `Task.replace` replaced) of the last attempt that ended in a retry: a late
-- copy of that attempt, or of an earlier one, must not run again. With a lease
-- of 0 it only looks (once.look, for a drain): the same answer, no claim taken.
-- The keys carry the task id as hash tag, so this also runs on Redis Cluster.
--
-- KEYS[1] run claim key   KEYS[2] revoke record key   KEYS[3] finished record key
-- ARGV[1] owner   ARGV[2] lease ms (0: look only)   ARGV[3] this copy's attempt number
-- Returns 0 when claimed (lease 0: when free), -1 when the task was revoked, -2 when it (this
-- attempt) finished (once.Refused), else the ms until the current holder's claim expires.
local claim, revoked, finished = KEYS[1], KEYS[2], KEYS[3]
local owner, lease, attempt = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
if redis.call('EXISTS', revoked) == 1 then return -1 end
local ended = redis.call('GET', finished)
if ended == 'F' or (ended and tonumber(ended) and tonumber(ended) >= attempt) then return -2 end
if lease > 0 and redis.call('SET', claim, owner, 'NX', 'PX', lease) then return 0 end
local left = redis.call('PTTL', claim)
if left == -2 then return 0 end
return math.max(1, left)
