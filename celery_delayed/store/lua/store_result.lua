-- Write a task's result unless a terminal one (SUCCESS, FAILURE, REVOKED) is
-- already there: the first terminal result of a task id is final, so a late
-- duplicate run can neither overwrite it nor set it back to STARTED/RETRY.
-- Publishes the value as Celery's Redis backend does, for waiting clients.
--
-- KEYS[1] result key   ARGV[1] encoded meta (JSON)   ARGV[2] expiry seconds (0 = none)
-- Returns 1 when written, 0 when a terminal result was kept.
local key, value, expires = KEYS[1], ARGV[1], tonumber(ARGV[2])
local current = redis.call('GET', key)
if current then
  local ok, meta = pcall(cjson.decode, current)
  if ok and type(meta) == 'table' and
     (meta.status == 'SUCCESS' or meta.status == 'FAILURE' or meta.status == 'REVOKED') then
    return 0
  end
end
if expires > 0 then
  redis.call('SET', key, value, 'EX', expires)
else
  redis.call('SET', key, value)
end
redis.call('PUBLISH', key, value)
return 1
