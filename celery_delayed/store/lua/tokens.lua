-- Take up to `want` tokens from a queue's token bucket, the dispatch rate limit every
-- poller shares (delayed_queue_rates), or give `-want` unused ones back. The bucket
-- refills at `rate` tokens a second by Redis' clock, up to `burst`, and starts full;
-- unused for a minute, it is forgotten (full again).
--
-- KEYS[1] token bucket HASH (tokens, at ms)
-- ARGV[1] rate (tokens/s)   ARGV[2] burst   ARGV[3] tokens wanted (negative: given back)
-- Returns the tokens taken (0 when giving back).
local key = KEYS[1]
local rate, burst, want = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + tonumber(t[2]) / 1000
local state = redis.call('HMGET', key, 'tokens', 'at')
local tokens = tonumber(state[1]) or burst
local at = tonumber(state[2]) or now
tokens = math.min(burst, tokens + math.max(0, now - at) * rate / 1000)
local taken = 0
if want < 0 then
  tokens = math.min(burst, tokens - want)
else
  taken = math.min(want, math.floor(tokens))
  tokens = tokens - taken
end
redis.call('HSET', key, 'tokens', string.format('%.6f', tokens), 'at', string.format('%.3f', now))
redis.call('PEXPIRE', key, 60000)
return taken
