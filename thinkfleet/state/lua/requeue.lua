-- producer retry: Take prompts out of the dead HASH (ARGV[1] == 'dead') or the done SET ('done'), clear their crash
-- counts, and decrement the counter named ARGV[1] by what was actually removed (a prompt missing from
-- ``done`` after a Redis loss does not make the counters go wrong).
-- KEYS: dead | done, counters, deliveries, then the dataset counters each prompt names by index
-- ARGV: 'dead' | 'done', then per prompt: prompt_id, 1-based index of its dataset key after KEYS[3]
local field = ARGV[1]
local removed, per_ds = 0, {}
for i = 2, #ARGV, 2 do
  local pid = ARGV[i]
  local gone
  if field == 'dead' then gone = redis.call('HDEL', KEYS[1], pid) else gone = redis.call('SREM', KEYS[1], pid) end
  redis.call('HDEL', KEYS[3], pid)
  if gone == 1 then
    removed = removed + 1
    local k = 3 + tonumber(ARGV[i + 1])
    per_ds[k] = (per_ds[k] or 0) + 1
  end
end
if removed > 0 then redis.call('HINCRBY', KEYS[2], field, -removed) end
for k, n in pairs(per_ds) do redis.call('HINCRBY', KEYS[k], field, -n) end
return removed
