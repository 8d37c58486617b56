-- Release a run claim, only if this worker still holds it (a claim that expired
-- and was taken by another worker is not ours to delete).
--
-- KEYS[1] run claim key   ARGV[1] owner
-- Returns 1 when released, 0 otherwise.
local claim, owner = KEYS[1], ARGV[1]
if redis.call('GET', claim) == owner then
  return redis.call('DEL', claim)
end
return 0
