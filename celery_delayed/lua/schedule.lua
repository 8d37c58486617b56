-- Schedule tasks in one partition. A task id that is already stored (due or in
-- flight) keeps its entry untouched, so callers may safely retry; within one
-- call, the first copy of an id wins.
-- Each task goes to the small sorted set of its time bucket; the bucket index
-- keeps each bucket's earliest due time (ZADD LT). The client sends every
-- message already behind its 4-byte bucket start (how cancel and reschedule
-- find a task's bucket from its id), so this script only reads it back. One
-- ZADD per bucket and one for the index, whatever the number of tasks.
-- When a new task is due sooner than everything already there, the pollers are
-- woken (PUBLISH) so they need not wait for their current sleep to end.
--
-- KEYS[1] bucket index ZSET (bucket start s -> earliest due ms)   KEYS[2] msg HASH
-- ARGV[1] wake channel   ARGV[2] bucket key prefix
-- then triples: task_id, due_ms, bucket start (4 bytes) + envelope (at most 256: unpack() has limits)
-- Returns the number of tasks added.
local ids = {}
for i = 3, #ARGV, 3 do ids[#ids + 1] = ARGV[i] end
if #ids == 0 then return 0 end
local stored = redis.call('HMGET', KEYS[2], unpack(ids))
local seen, messages, buckets, order, earliest = {}, {}, {}, {}, nil
for n, id in ipairs(ids) do
  if not stored[n] and not seen[id] then
    seen[id] = true
    local due, message = ARGV[3 * n + 1], ARGV[3 * n + 2]
    local bucket = struct.unpack('>I4', message)
    local members = buckets[bucket]
    if members == nil then
      members = {}
      buckets[bucket] = members
      order[#order + 1] = bucket
    end
    members[#members + 1] = due
    members[#members + 1] = id
    messages[#messages + 1] = id
    messages[#messages + 1] = message
    due = tonumber(due)
    if earliest == nil or due < earliest then earliest = due end
  end
end
if earliest == nil then return 0 end
local head = redis.call('ZRANGE', KEYS[1], 0, 0, 'WITHSCORES')
local index = {}
for _, bucket in ipairs(order) do
  local members = buckets[bucket]
  redis.call('ZADD', ARGV[2] .. bucket, unpack(members))
  local first = tonumber(members[1])
  for i = 3, #members, 2 do first = math.min(first, tonumber(members[i])) end
  index[#index + 1] = first
  index[#index + 1] = bucket
end
redis.call('ZADD', KEYS[1], 'LT', unpack(index))
redis.call('HSET', KEYS[2], unpack(messages))
if head[2] == nil or earliest < tonumber(head[2]) then
  redis.call('PUBLISH', ARGV[1], earliest)
end
return #messages / 2
