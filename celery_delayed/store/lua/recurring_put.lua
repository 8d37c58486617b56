-- Write or delete one recurring schedule's definition if it is still the version the caller read:
-- concurrent writers (pollers syncing beat_schedule at once, an API call) never both win one version.
-- A poller advancing the chain (ARGV[4] = '1') writes only a later pending occurrence, or none (the
-- chain ended) over one, so a late poller never moves it back.  A put whose pending occurrence is
-- still to be written (ARGV[5] = '1') marks the schedule in the same step, version and all: a put
-- interrupted before that write is found and completed by a poller, at its start or once the mark is
-- old (lua/recurring_put_done.lua clears the mark once the occurrence is written).
--
-- KEYS[1] definitions HASH (schedule id -> definition: its version and pending_ms, null once ended, in its
--         first line, lua/_definition.lua)
-- KEYS[2] pending puts HASH (schedule id -> the version whose pending occurrence is being written)
-- ARGV[1] schedule id   ARGV[2] version read (0: none stored)   ARGV[3] new JSON, or '' to delete
-- ARGV[4] '1': only if the new pending_ms is later than the stored one (or null, the stored one not), else ''
-- ARGV[5] new version: mark the put as pending in KEYS[2] at that version, or '' (no mark)
-- Returns 1 when written (or deleted), 0 when the stored definition is not the one read (or, with
-- ARGV[4], the new one does not move the pending occurrence later).
--- @include _definition
local stored = redis.call('HGET', KEYS[1], ARGV[1])
local version, old = 0, nil
if stored then version, old = definition_of(stored) end
if version ~= tonumber(ARGV[2]) then return 0 end
if ARGV[3] == '' then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return 1
end
if ARGV[4] == '1' and stored then
  local _, new = definition_of(ARGV[3])
  if old == cjson.null or (new ~= cjson.null and new <= old) then return 0 end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if ARGV[5] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[5]) end
return 1
