-- Release a run claim, only if this worker still holds it (a claim that expired
-- and was taken by another worker is not ours to delete).
--
-- KEYS[1] run claim key   ARGV[1] owner
-- Returns 1 when released, 0 otherwise.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
