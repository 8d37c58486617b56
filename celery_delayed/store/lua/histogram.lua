-- Count one partition's tasks by due time, for the web view's load histogram,
-- from the bucket index alone: every bucket starting in [from, to) is counted
-- whole (ZCARD) into the bin of its start. `from` and `bin` are multiples of
-- the bucket width, so a bucket never straddles two bins and a bucket starting
-- before `from` (whose earliest task is before it) is never selected. Every lane
-- (_buckets.lua) counts.
--
-- KEYS[1] bucket index ZSET   KEYS[2] lanes ZSET
-- ARGV[1] bucket key prefix   ARGV[2] from ms   ARGV[3] to ms (excluded)   ARGV[4] bin ms
-- Returns {tasks in bin 0, tasks in bin 1, ...}: (to - from) / bin counts.
--- @include _buckets
local index, lanes = KEYS[1], KEYS[2]
local prefix, from, to, bin = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local bins = {}
for i = 1, math.ceil((to - from) / bin) do bins[i] = 0 end
for _, lane in ipairs(all_lanes(lanes)) do
  local lane_index, lane_prefix = lane_keys(index, prefix, lane)
  for _, b in ipairs(redis.call('ZRANGE', lane_index, from, '(' .. to, 'BYSCORE')) do
    local i = math.floor((tonumber(b) * 1000 - from) / bin) + 1
    if bins[i] then bins[i] = bins[i] + redis.call('ZCARD', lane_prefix .. b) end
  end
end
return bins
