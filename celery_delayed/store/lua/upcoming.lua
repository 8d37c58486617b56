-- Read the next tasks of one partition in (due, id) order, after a position.
-- Buckets cover disjoint time ranges, so walking the index from the bucket
-- holding the position visits tasks in due order, ties by stored id (as within
-- a sorted set). The position is a task's (due, id), kept even when that task
-- is gone since (cancelled, dispatched): the read starts at the first task
-- after it, found by a binary search in the run of tasks due exactly then, so
-- neither a removal nor an insertion before it shifts the read, and a long run
-- of tasks due at one time costs O(log n) to enter, not a scan.
--
-- KEYS[1] bucket index ZSET
-- ARGV[1] bucket key prefix   ARGV[2] bucket width s
-- ARGV[3] position's due ms ('' = from the earliest task)
-- ARGV[4] position's stored id ('' = every task due at ARGV[3] or later)
-- ARGV[5] most tasks to return
-- Returns {id, due_ms, id, due_ms, ...}.
local index = KEYS[1]
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

local out, offset = {}, 0
while #out < 2 * count do
  local buckets = redis.call('ZRANGE', index, from, '+inf', 'BYSCORE', 'LIMIT', offset, 64)
  if #buckets == 0 then break end
  offset = offset + #buckets
  for _, b in ipairs(buckets) do
    local key = prefix .. b
    local rank = (first and tonumber(b) == first) and rank_after(key) or 0
    local rows = redis.call('ZRANGE', key, rank, rank + count - #out / 2 - 1, 'WITHSCORES')
    for i = 1, #rows do out[#out + 1] = rows[i] end
    if #out >= 2 * count then break end
  end
end
return out
