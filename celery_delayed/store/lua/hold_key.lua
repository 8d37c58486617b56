-- Point a replace-by-key key (the delayed_key header) at a task: the key index of the
-- key's partition maps each key to the one task scheduled under it.
--
-- KEYS[1] key index (HASH key -> task id)
-- ARGV[1] key   ARGV[2] task id
-- ARGV[3] the holder the caller saw ("" for none): the key is taken only if it still is; "*" takes it
--         whatever holds it (replace).
-- Returns {1, previous holder or nil} when the key now points at the task,
--         {0, current holder} when another task took the key since the caller looked.
local index, key, task_id, expected = KEYS[1], ARGV[1], ARGV[2], ARGV[3]
local current = redis.call('HGET', index, key)
if expected ~= '*' and (current or '') ~= expected then
  return {0, current}
end
redis.call('HSET', index, key, task_id)
return {1, current}
