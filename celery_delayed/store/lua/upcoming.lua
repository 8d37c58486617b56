-- Read the next tasks of one partition in (due, id) order, after a position.
-- Buckets cover disjoint time ranges, so walking the index from the bucket
-- holding the position visits tasks in due order, ties by stored id (as within
-- a sorted set). The position is a task's (due, id), kept even when that task
-- is gone since (cancelled, dispatched): the read starts at the first task
-- after it, found by a binary search in the run of tasks due exactly then, so
-- neither a removal nor an insertion before it shifts the read, and a long run
-- of tasks due at one time costs O(log n) to enter, not a scan.
--
-- Every lane (_buckets.lua) is read that way, and the lanes' tasks merged.
--
-- KEYS[1] bucket index ZSET   KEYS[2] lanes ZSET
-- ARGV[1] bucket key prefix   ARGV[2] bucket width s
-- ARGV[3] position's due ms ('' = from the earliest task)
-- ARGV[4] position's stored id ('' = every task due at ARGV[3] or later)
-- ARGV[5] most tasks to return
-- Returns {id, due_ms, id, due_ms, ...}.
--- @include _buckets
local index, lanes = KEYS[1], KEYS[2]
local prefix, width, due, after, count = ARGV[1], tonumber(ARGV[2]), ARGV[3], ARGV[4], tonumber(ARGV[5])
local start, from, first = nil, '-inf', nil
if due ~= '' then
  start = tonumber(due)
  first = math.floor(start / 1000 / width) * width
  from = first * 1000
end

-- Whether stored id a sorts before b as Redis orders equal scores (bytewise; Lua's own
-- comparison follows the locale).
local function before(a, b)
  for i = 1, math.min(#a, #b) do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

-- The rank in bucket `key` of its first task after the position.
local function rank_after(key)
  local lo = redis.call('ZCOUNT', key, '-inf', '(' .. start)
  if after == '' then return lo end
  local hi = lo + redis.call('ZCOUNT', key, start, start)
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if before(after, redis.call('ZRANGE', key, mid, mid)[1]) then hi = mid else lo = mid + 1 end
  end
  return lo
end

-- The first `count` tasks after the position in one lane, as {id, due} rows.
local function read(lane_index, lane_prefix)
  local rows, offset = {}, 0
  while #rows < count do
    local buckets = redis.call('ZRANGE', lane_index, from, '+inf', 'BYSCORE', 'LIMIT', offset, 64)
    if #buckets == 0 then break end
    offset = offset + #buckets
    for _, b in ipairs(buckets) do
      local key = lane_prefix .. b
      local rank = (first and tonumber(b) == first) and rank_after(key) or 0
      local found = redis.call('ZRANGE', key, rank, rank + count - #rows - 1, 'WITHSCORES')
      for i = 1, #found, 2 do rows[#rows + 1] = {found[i], found[i + 1]} end
      if #rows >= count then break end
    end
  end
  return rows
end

local rows = {}
for _, lane in ipairs(all_lanes(lanes)) do
  for _, row in ipairs(read(lane_keys(index, prefix, lane))) do rows[#rows + 1] = row end
end
table.sort(rows, function(a, b)
  local x, y = tonumber(a[2]), tonumber(b[2])
  if x ~= y then return x < y end
  return before(a[1], b[1])
end)
local out = {}
for i = 1, math.min(count, #rows) do
  out[#out + 1] = rows[i][1]
  out[#out + 1] = rows[i][2]
end
return out
