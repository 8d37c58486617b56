-- Clear the marks of puts whose pending occurrence is written (lua/recurring_put.lua set them): each
-- only if it still names the version written, so a later put of the schedule, still writing its own
-- occurrence, keeps its mark.
--
-- KEYS[1] pending puts HASH (schedule id -> version)
-- ARGV    schedule id, version, schedule id, version...
-- Returns how many marks were cleared.
local cleared = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    cleared = cleared + redis.call('HDEL', KEYS[1], ARGV[i])
  end
end
return cleared
