-- Shared steps of the bucket layout (store/delayed.py's module doc), put in front of a
-- script that says "--- @include _buckets".
--
-- A partition's tasks are split into lanes, one per queue, so that one queue's backlog
-- never stands in front of another queue's due tasks (claim.lua takes from each due
-- lane in turn). Lane L keeps its buckets under `<prefix>L:` and its bucket index at
-- `<index>:L`; the lanes ZSET holds each lane's earliest due time. Lane "" holds the
-- tasks stored before lanes (layout format 1) under the partition's own index and
-- prefix, and is not in the lanes ZSET: scripts read its index head directly.
--
-- A stored message is its bucket's start (4 bytes, big-endian); then, in a named lane,
-- a NUL, the lane's length (1 byte) and the lane; then the task's envelope. In lane ""
-- an envelope starting with a NUL comes after an empty lane head (NUL, length 0), so
-- that its NUL is not read as a lane head.

-- The bucket start a stored message records.
local function bucket_of(message)
  return (struct.unpack('>I4', message))
end

-- The lane a stored message records ('' for a message stored before lanes).
local function lane_of(message)
  if string.byte(message, 5) ~= 0 then return '' end
  return string.sub(message, 7, 6 + string.byte(message, 6))
end

-- The envelope of a stored message.
local function envelope_of(message)
  if string.byte(message, 5) ~= 0 then return string.sub(message, 5) end
  return string.sub(message, 7 + string.byte(message, 6))
end

-- The start of the bucket of due time `due` (ms), buckets `width` seconds wide.
local function bucket_for(due, width)
  return math.floor(due / 1000 / width) * width
end

-- The bucket index and bucket key prefix of lane `lane` of the partition whose own (lane
-- "") index and prefix are `index` and `prefix`.
local function lane_keys(index, prefix, lane)
  if lane == '' then return index, prefix end
  return index .. ':' .. lane, prefix .. lane .. ':'
end

-- The lanes of a partition: lane "" first, then each named lane.
local function all_lanes(lanes)
  local out = redis.call('ZRANGE', lanes, 0, -1)
  table.insert(out, 1, '')
  return out
end

-- The keys this script emptied, and so deleted. On a Redis Cluster, a script may use a key of a
-- slot being migrated only while the key is on the node: a command on a key gone (moved on, or
-- deleted by the script itself) fails the script midway, its earlier writes kept. So a key this
-- script emptied reads as empty, never from Redis, and is not written again (scripts add before
-- they remove).
local gone = {}

-- ZRANGE `key` `...`: nothing when `key` is gone.
local function zrange(key, ...)
  if gone[key] then return {} end
  return redis.call('ZRANGE', key, ...)
end

-- ZREM `...` from ZSET `key`, noting in `gone` a key left empty.
local function remove(key, ...)
  local held = redis.call('ZCARD', key)
  if redis.call('ZREM', key, ...) == held then gone[key] = true end
end

-- The earliest due time (ms) of lane index `lane_index`, or nil when the lane is empty.
local function lane_head(lane_index)
  local head = zrange(lane_index, 0, 0, 'WITHSCORES')[2]
  return head and tonumber(head)
end

-- The partition's earliest due time (ms) over every lane but those in set `closed` (a
-- table lane -> true, of `skip` lanes: paused or rate-limited), or nil when no such lane
-- holds a task.
local function earliest_due(lanes, index, closed, skip)
  local first = lane_head(index)
  local heads = zrange(lanes, 0, skip or 0, 'WITHSCORES')
  for i = 1, #heads, 2 do
    if not (closed and closed[heads[i]]) then
      local head = tonumber(heads[i + 1])
      if first == nil or head < first then first = head end
      break
    end
  end
  return first
end

-- After tasks left bucket `bucket` (key `key`) of lane `lane` (index `lane_index`): its
-- index entry becomes its earliest remaining due time, or goes with the emptied bucket,
-- and so does the lane's entry in the lanes ZSET.
local function refresh_bucket(lanes, lane_index, key, bucket, lane)
  local rest = zrange(key, 0, 0, 'WITHSCORES')
  if rest[2] then redis.call('ZADD', lane_index, rest[2], bucket) else remove(lane_index, bucket) end
  if lane ~= '' then
    local head = lane_head(lane_index)
    if head then redis.call('ZADD', lanes, head, lane) else remove(lanes, lane) end
  end
end

-- The bucket key of stored message `message`.
local function bucket_key_of(index, prefix, message)
  local _, lane_prefix = lane_keys(index, prefix, lane_of(message))
  return lane_prefix .. bucket_of(message)
end

-- Take task `id` (stored as `message`) out of its bucket, refreshing the indexes; the bucket and
-- its lane index are read before the first write (see `gone`).
local function take_from_bucket(lanes, index, prefix, id, message)
  local lane, bucket = lane_of(message), bucket_of(message)
  local lane_index, lane_prefix = lane_keys(index, prefix, lane)
  redis.call('EXISTS', lane_index)
  remove(lane_prefix .. bucket, id)
  refresh_bucket(lanes, lane_index, lane_prefix .. bucket, bucket, lane)
end

-- Put task `id` in bucket `bucket` of its lane at due time `due`, its stored `message`
-- (lane and envelope kept) recording the bucket. The indexes come first: cut short by a key
-- not on the node (see `gone`), this leaves at most an index entry ahead of its bucket, which
-- a claim refreshes, never a task its indexes do not lead to.
local function put_in_bucket(lanes, index, msgs, prefix, bucket, id, due, message)
  local lane = lane_of(message)
  local lane_index, lane_prefix = lane_keys(index, prefix, lane)
  redis.call('ZADD', lane_index, 'LT', due, bucket)
  if lane ~= '' then redis.call('ZADD', lanes, 'LT', due, lane) end
  redis.call('ZADD', lane_prefix .. bucket, due, id)
  redis.call('HSET', msgs, id, struct.pack('>I4', bucket) .. string.sub(message, 5))
end
