-- producer submit after a Redis loss: prompts storage holds join the done set again (done caches storage), the
-- job's and each dataset's 'done' counter following by what was actually added (a prompt a worker finalized
-- meanwhile is not counted twice).
-- KEYS: done, counters, then the dataset counters each prompt names by index
-- ARGV: per prompt: prompt_id, 1-based index of its dataset key after KEYS[2]
local added, per_ds = 0, {}
for i = 1, #ARGV, 2 do
  if redis.call('SADD', KEYS[1], ARGV[i]) == 1 then
    added = added + 1
    local k = 2 + tonumber(ARGV[i + 1])
    per_ds[k] = (per_ds[k] or 0) + 1
  end
end
if added > 0 then redis.call('HINCRBY', KEYS[2], 'done', added) end
for k, n in pairs(per_ds) do redis.call('HINCRBY', KEYS[k], 'done', n) end
return added
