-- Extend a run claim this worker holds, while its task still runs.
--
-- KEYS[1] run claim key   ARGV[1] owner   ARGV[2] lease ms
-- Returns 1 when extended, 0 when the claim is not ours (any more).
local claim, owner, lease = KEYS[1], ARGV[1], ARGV[2]
if redis.call('GET', claim) == owner then
  return redis.call('PEXPIRE', claim, lease)
end
return 0
