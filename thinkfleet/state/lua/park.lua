-- Move a job's messages from one queue list to its parked list, one slice per call (a short block).
-- KEYS: queue list, parked ; ARGV: start, count, task-id prefix ("job/")
-- Returns {next start, queue length, moved}. Matching messages are removed where they are (LREM from the
-- head finds them at about `start`) and appended to parked in queue order, in this one atomic call.
local items = redis.call('LRANGE', KEYS[1], ARGV[1], tonumber(ARGV[1]) + tonumber(ARGV[2]) - 1)
local prefix = ARGV[3]
local moved = 0
for _, m in ipairs(items) do
  local _, e = string.find(m, '"id": "', math.max(1, #m - 4096), true)
  if not e then _, e = string.find(m, '"id"%s*:%s*"') end
  local id = e and string.match(m, '^([^"\\]*)"', e + 1)
  if id and string.sub(id, 1, #prefix) == prefix then
    redis.call('LREM', KEYS[1], 1, m)
    redis.call('RPUSH', KEYS[2], m)
    moved = moved + 1
  end
end
return {tonumber(ARGV[1]) + #items - moved, redis.call('LLEN', KEYS[1]), moved}
