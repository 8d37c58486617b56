-- Claim the due tasks of one partition for the partition's current leader.
-- Redis' own clock (TIME) decides what is due, so poller clock skew cannot fire
-- tasks early or late; "due" is "due within the dispatch lead" (the worker holds
-- a task that arrives early until its due time). Claimed tasks move to the inflight set with a visibility
-- deadline; the poller removes them (ack.lua) once Kafka confirmed delivery.
-- Inflight tasks past their deadline (their claimer died) become due again.
-- Each lane (queue, see _buckets.lua) with due tasks gets an equal share of the
-- claim, and what a lane leaves of its share goes to the lanes that filled theirs:
-- a backlog of one queue never holds another queue's due tasks behind it. Within
-- a lane, due tasks are taken bucket by bucket in its index's order; a bucket left
-- with tasks gets its new earliest due time in the index, an emptied one leaves it.
-- A paused lane (a paused queue) gives nothing, and its due time is not the
-- partition's next: its tasks wait in the store until it is resumed; it is never
-- throttled, capped or not. A capped lane (a rate-limited queue: the tokens its poller
-- holds, 0 for none) gives at most its cap; once that is spent, it is closed for the
-- rest of the claim, and the reply names it if it still had due tasks (throttled): the
-- poller comes back when it has tokens for it. Its next task not yet due is the
-- partition's next due time as any lane's is.
-- Each claim comes with a request id, recorded with its stamp. A claim whose reply was lost
-- is sent again with the same id (DelayedStore.claim): when it is still the partition's last
-- claim, its tasks still in flight are due again at once (not after the visibility timeout),
-- at that claim's horizon (the latest due time they can have: none runs early; within this claim's,
-- as its deadline may be a handover's, below), and claimed as any due task is (a queue paused
-- meanwhile keeps its tasks).
-- A new leader (a token above the fence) takes over what its predecessors left in flight: a leader
-- killed between its claim and Kafka's confirmation never acks those copies, and they would wait out
-- the visibility timeout. Every copy in flight when the token rises is due again at once, at its own
-- claim's horizon (its deadline - visibility + lead, within this claim's: none runs early, none waits),
-- up to ARGV[2] a claim: the highest deadline among them is kept (handover key) until all are back,
-- then 0 (the key stays: a script declaring a key its node lacks is refused while its slot migrates).
-- Until then a claim's deadline is above the handover's: a predecessor's later deadlines (its longer
-- visibility timeout, or Redis' clock stepped back) would have the next claims take this leader's own
-- copies back as its predecessor's, lowest deadline first, again and again, and leave the others waiting.
-- A predecessor still alive (partitioned off etcd) may deliver a copy too: the worker runs a task id
-- once, and its ack, of the old stamp, leaves the new claim's copy alone (ack.lua).
--
-- KEYS[1] bucket index ZSET   KEYS[2] msg HASH   KEYS[3] inflight ZSET   KEYS[4] lanes ZSET
-- KEYS[5] fence STRING   KEYS[6] last claim stamp STRING   KEYS[7] last claim: "<request id> <stamp>" STRING
-- KEYS[8] handover: the highest deadline in flight when a new leader came, until all are due again, or 0 STRING
-- ARGV[1] fencing token (fencing epoch and etcd create revision of the leader key as one number, leadership.token_of)
-- ARGV[2] most tasks to claim   ARGV[3] visibility timeout ms
-- ARGV[4] bucket key prefix   ARGV[5] bucket width s   ARGV[6] dispatch lead ms   ARGV[7] request id
-- ARGV[8] number of paused lanes n   ARGV[9 .. 8 + n] the paused lanes   then pairs: lane, cap
-- Returns {now_ms, next_due_ms or -1, stamp, {throttled lane, ...}, id, due_ms, id, due_ms, ...}; fails with
-- FENCED when a newer leader has claimed this partition. The messages are not in the reply: the client
-- reads them with HMGET, then ZMSCORE (DelayedStore.claim), and keeps those still in flight under this
-- claim's stamp, as no write changes a message while it is (each write that replaces or removes one
-- takes it out of flight first, and a stamp names one claim). Passed through Lua, the messages made
-- this script, which no other client can interleave with, half as long again (bench.responsive). An id
-- claimed without a message (a bucket entry left by a schedule.lua a slot migration cut short) leaves
-- inflight when its claim expires or is nacked, or when the id is scheduled again (schedule.lua).
--- @include _buckets
local index, msgs, inflight, lanes, fence_key, stamp_key, claim_key, handover_key = KEYS[1], KEYS[2], KEYS[3],
  KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8]
local prefix, request = ARGV[4], ARGV[7]
local token = tonumber(ARGV[1])
local fence = tonumber(redis.call('GET', fence_key) or '0')
if token < fence then
  return redis.error_reply('FENCED token ' .. ARGV[1] .. ' is older than ' .. fence)
end
if token > fence then
  redis.call('SET', fence_key, ARGV[1])
  local top = redis.call('ZRANGE', inflight, '+inf', '-inf', 'BYSCORE', 'REV', 'LIMIT', 0, 1, 'WITHSCORES')
  redis.call('SET', handover_key, top[2] or '0')
end

local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local limit = tonumber(ARGV[2])
local width = tonumber(ARGV[5])
local visibility, lead = tonumber(ARGV[3]), tonumber(ARGV[6])
local horizon = now + lead
local closed, caps, shut, paused = {}, {}, 0, {}  -- closed: paused or capped to 0; shut: how many
for i = 9, 8 + tonumber(ARGV[8]) do
  closed[ARGV[i]] = true
  paused[ARGV[i]] = true
  shut = shut + 1
end
for i = 9 + tonumber(ARGV[8]), #ARGV, 2 do
  caps[ARGV[i]] = tonumber(ARGV[i + 1])
  if caps[ARGV[i]] <= 0 and not closed[ARGV[i]] then
    closed[ARGV[i]] = true
    shut = shut + 1
  end
end

-- Claimed tasks `ids` go back to their buckets, due at `due`, message and all (bucket first,
-- as in nack.lua, so a failure on an undeclared key leaves the task in flight).
local function due_again(ids, due)
  local bucket = bucket_for(due, width)
  for _, id in ipairs(ids) do
    local message = redis.call('HGET', msgs, id)
    if message then put_in_bucket(lanes, index, msgs, prefix, bucket, id, due, message) end
    remove(inflight, id)
  end
end

-- expired claims are due now; those of this request sent again at its horizon (within this claim's), or now
due_again(redis.call('ZRANGE', inflight, '-inf', now, 'BYSCORE', 'LIMIT', 0, limit), now)
local last = redis.call('GET', stamp_key) or '0'
if redis.call('GET', claim_key) == request .. ' ' .. last then
  due_again(zrange(inflight, last, last, 'BYSCORE'), math.max(now, math.min(tonumber(last) - visibility + lead, horizon)))
end
-- a predecessor's copies, each at its claim's horizon (clamped to this claim's: see the header)
local handover = tonumber(redis.call('GET', handover_key) or '0')
if handover > 0 then
  local left = zrange(inflight, '-inf', handover, 'BYSCORE', 'LIMIT', 0, limit, 'WITHSCORES')
  for i = 1, #left, 2 do
    due_again({left[i]}, math.max(now, math.min(tonumber(left[i + 1]) - visibility + lead, horizon)))
  end
  if #left < 2 * limit then
    redis.call('SET', handover_key, '0')
    handover = 0
  end
end

-- (at most a second past now + visibility: a clock stepped back must not stretch deadlines;
-- but during a handover above it and the last stamp: its next claims must not take this one's copies back)
local deadline = now + visibility
last = tonumber(last)
if last >= deadline and last < deadline + 1000 then deadline = last + 1 end
if handover > 0 and deadline <= math.max(handover, last) then deadline = math.max(handover, last) + 1 end
redis.call('SET', stamp_key, deadline)
redis.call('SET', claim_key, request .. ' ' .. deadline)
local out = {now, -1, deadline, {}}

-- Claim up to `most` due tasks of lane `lane`; returns how many ids it took.
local function take(lane, most)
  local lane_index, lane_prefix = lane_keys(index, prefix, lane)
  local left = most
  local buckets = zrange(lane_index, '-inf', horizon, 'BYSCORE', 'LIMIT', 0, most)
  for _, b in ipairs(buckets) do
    if left <= 0 then break end
    local key = lane_prefix .. b
    local due = redis.call('ZRANGE', key, '-inf', horizon, 'BYSCORE', 'LIMIT', 0, left, 'WITHSCORES')
    if #due > 0 then
      -- one variadic call per step, not one per task (ARGV[2] <= 5000: within unpack's reach);
      -- in flight before they leave the bucket: inflight, when the expired above emptied it, is
      -- gone from the node, and a slot migration fails the script at that ZADD (`gone`, _buckets.lua)
      local ids = {}
      for i = 1, #due, 2 do ids[#ids + 1] = due[i] end
      local claimed = {}
      for j, id in ipairs(ids) do
        claimed[#claimed + 1] = deadline
        claimed[#claimed + 1] = id
        out[#out + 1] = id
        out[#out + 1] = due[2 * j]
      end
      for i = 1, #claimed, 2000 do  -- score/member pairs: chunks of 1000
        redis.call('ZADD', inflight, unpack(claimed, i, math.min(i + 1999, #claimed)))
      end
      -- the due are the bucket's first by rank, so they leave by rank, without a lookup each
      local held = redis.call('ZCARD', key)
      if redis.call('ZREMRANGEBYRANK', key, 0, #ids - 1) == held then gone[key] = true end
      left = left - #ids
    end
    refresh_bucket(lanes, lane_index, key, b, lane)
  end
  return most - left
end

-- the due lanes: each named lane not closed whose earliest task is due, and lane "" when its is
local open = {}
for _, lane in ipairs(redis.call('ZRANGE', lanes, '-inf', horizon, 'BYSCORE')) do
  if not closed[lane] then open[#open + 1] = lane end
end
local first = lane_head(index)
if first and first <= horizon then table.insert(open, 1, '') end
local left = limit
while left > 0 and #open > 0 do
  local full = {}  -- the lanes that took their whole share, and may hold more due tasks
  for i, lane in ipairs(open) do
    local share = math.ceil(left / (#open - i + 1))
    if caps[lane] then share = math.min(share, caps[lane]) end
    local took = take(lane, share)
    left = left - took
    if caps[lane] then
      caps[lane] = caps[lane] - took
      if caps[lane] <= 0 then
        closed[lane] = true
        shut = shut + 1
      end
    end
    if took == share and not closed[lane] then full[#full + 1] = lane end
  end
  open = full
end

-- a capped lane closed with tasks still due is throttled; one whose next task is not due
-- yet gives its due time, as an open lane does (a paused one does neither)
for lane, cap in pairs(caps) do
  if cap <= 0 and not paused[lane] then
    local head = not gone[lanes] and redis.call('ZSCORE', lanes, lane)
    if head and tonumber(head) <= horizon then
      table.insert(out[4], lane)
    else
      closed[lane] = nil
      shut = shut - 1
    end
  end
end
out[2] = earliest_due(lanes, index, closed, shut) or -1
return out
