-- Shared steps of the bucket layout (store.py's module doc), put in front of a script
-- that says "--- @include _buckets". A stored message is its bucket's start (4 bytes,
-- big-endian) followed by the task's envelope.

-- The bucket start a stored message records.
local function bucket_of(message)
  return (struct.unpack('>I4', message))
end

-- The envelope of a stored message.
local function envelope_of(message)
  return string.sub(message, 5)
end

-- The start of the bucket of due time `due` (ms), buckets `width` seconds wide.
local function bucket_for(due, width)
  return math.floor(due / 1000 / width) * width
end

-- After tasks left bucket `bucket` (key `key`): its index entry becomes its earliest
-- remaining due time, or goes with the emptied bucket.
local function refresh_bucket(index, key, bucket)
  local rest = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
  if rest[2] then redis.call('ZADD', index, rest[2], bucket) else redis.call('ZREM', index, bucket) end
end

-- Put task `id` in bucket `bucket` (key prefix `prefix`) at due time `due`, its stored
-- `message` recording the bucket.
local function put_in_bucket(index, msgs, prefix, bucket, id, due, message)
  redis.call('ZADD', prefix .. bucket, due, id)
  redis.call('ZADD', index, 'LT', due, bucket)
  redis.call('HSET', msgs, id, struct.pack('>I4', bucket) .. envelope_of(message))
end
