-- Read the next tasks of one partition in due order, from a due time on.
-- Buckets cover disjoint time ranges, so walking the index from the bucket
-- holding the start time visits tasks in due order (ties by task id, as within
-- a sorted set).
--
-- KEYS[1] bucket index ZSET
-- ARGV[1] bucket key prefix   ARGV[2] bucket width s
-- ARGV[3] start due ms ('' = from the earliest)   ARGV[4] tasks due exactly at the start to skip
-- ARGV[5] most tasks to return
-- Returns {id, due_ms, id, due_ms, ...}.
local index = KEYS[1]
local prefix, width, first, skip, count = ARGV[1], tonumber(ARGV[2]), ARGV[3], tonumber(ARGV[4]), tonumber(ARGV[5])
local start, from = '-inf', '-inf'
if first ~= '' then
  start = tonumber(first)
  from = math.floor(start / 1000 / width) * width * 1000
end
local out, offset = {}, 0
while #out < 2 * count do
  local buckets = redis.call('ZRANGE', index, from, '+inf', 'BYSCORE', 'LIMIT', offset, 64)
  if #buckets == 0 then break end
  offset = offset + #buckets
  for _, b in ipairs(buckets) do
    local want = count - #out / 2 + skip
    local rows = redis.call('ZRANGE', prefix .. b, start, '+inf', 'BYSCORE', 'LIMIT', 0, want, 'WITHSCORES')
    for i = 1, #rows, 2 do
      if skip > 0 and tonumber(rows[i + 1]) == start then
        skip = skip - 1
      elseif #out < 2 * count then
        out[#out + 1] = rows[i]
        out[#out + 1] = rows[i + 1]
      end
    end
    if #out >= 2 * count then break end
  end
end
return out
