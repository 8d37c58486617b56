-- The version and pending occurrence (ms, or cjson.null once the chain ended) of a recurring schedule's
-- stored definition: its first line is JSON, [version, pending_ms, ...]; a definition of the first
-- format is one JSON object with "version" and "pending_ms" (no newline: JSON escapes them).
local function definition_of(stored)
  local head = cjson.decode(stored:sub(1, (stored:find('\n', 1, true) or 0) - 1))
  if head.version then return head.version, head.pending_ms end
  return head[1], head[2]
end
