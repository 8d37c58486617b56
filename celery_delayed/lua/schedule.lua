-- Schedule tasks in one partition. A task id that is already stored (due or in
-- flight) keeps its entry untouched, so callers may safely retry; within one
-- call, the first copy of an id wins.
-- Each task goes to the small sorted set of its time bucket (due ms // width),
-- and the bucket index keeps each bucket's earliest due time (ZADD LT). The
-- message is stored behind the 4-byte bucket start, which is how cancel and
-- reschedule find a task's bucket from its id.
-- When a new task is due sooner than everything already there, the pollers are
-- woken (PUBLISH) so they need not wait for their current sleep to end.
--
-- KEYS[1] bucket index ZSET (bucket start s -> earliest due ms)   KEYS[2] msg HASH
-- ARGV[1] wake channel   ARGV[2] bucket key prefix   ARGV[3] bucket width s
-- then triples: task_id, due_ms, envelope (at most 500: unpack() has limits)
-- Returns the number of tasks added.
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local width = tonumber(ARGV[3])
local ids = {}
for i = 4, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local stored = redis.call('HMGET', KEYS[2], unpack(ids))
local seen, messages, added, earliest = {}, {}, 0, nil
for n, id in ipairs(ids) do
  if not stored[n] and not seen[id] then
    seen[id] = true
    local due = tonumber(ARGV[3 * n + 2])
    local bucket = math.floor(due / 1000 / width) * width
    redis.call('ZADD', ARGV[2] .. bucket, due, id)
    redis.call('ZADD', KEYS[1], 'LT', due, bucket)
    messages[#messages + 1] = id
    messages[#messages + 1] = struct.pack('>I4', bucket) .. ARGV[3 * n + 3]
    added = added + 1
    if earliest == nil or due < earliest then earliest = due end
  end
end
if added == 0 then return 0 end
redis.call('HSET', KEYS[2], unpack(messages))
if head[2] == nil or earliest < tonumber(head[2]) then
  redis.call('PUBLISH', ARGV[1], earliest)
end
return added
