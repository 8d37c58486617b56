-- Let go of a replace-by-key key once its task has ended, only if that task still holds it
-- (a newer task under the same key is not ours to forget).
--
-- KEYS[1] key index (HASH key -> task id)   ARGV[1] key   ARGV[2] task id
-- Returns 1 when released, 0 when another task (or none) holds the key.
local index, key, task_id = KEYS[1], ARGV[1], ARGV[2]
if redis.call('HGET', index, key) == task_id then
  return redis.call('HDEL', index, key)
end
return 0
