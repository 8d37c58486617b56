-- Write a task's result unless a terminal one (SUCCESS, FAILURE, REVOKED) is
-- already there: the first terminal result of a task id is final, so a late
-- duplicate run can neither overwrite it nor set it back to STARTED/RETRY.
-- Publishes the value as Celery's Redis backend does, for waiting clients.
--
-- KEYS[1] result key   ARGV[1] encoded meta (JSON)   ARGV[2] expiry seconds (0 = none)
-- Returns 1 when written, 0 when a terminal result was kept.
local current = redis.call('GET', KEYS[1])
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and
     (meta.status == 'SUCCESS' or meta.status == 'FAILURE' or meta.status == 'REVOKED') then
    return 0
  end
end
if tonumber(ARGV[2]) > 0 then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
redis.call('PUBLISH', KEYS[1], ARGV[1])
return 1
