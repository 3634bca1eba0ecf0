-- Mark committed rows done (the part holding them is durable).
-- KEYS: done, claims, counters, dataset_counters, worker_counters, timeline, deliveries
-- ARGV: worker, now, alarm_min_rows, alarm_missing_share, then per row: prompt_id, tokens, think_end, truncated
local new_rows, tokens, think, trunc = 0, 0, 0, 0
local flags = {}
for i = 5, #ARGV, 4 do
  local pid = ARGV[i]
  redis.call('HDEL', KEYS[2], pid)
  redis.call('HDEL', KEYS[7], pid)
  if redis.call('SADD', KEYS[1], pid) == 1 then
    new_rows = new_rows + 1
    tokens = tokens + tonumber(ARGV[i + 1])
    think = think + tonumber(ARGV[i + 2])
    trunc = trunc + tonumber(ARGV[i + 3])
    flags[#flags + 1] = ARGV[i + 2]
  end
end
if new_rows == 0 then return {0, 0, 0, 0} end
redis.call('HINCRBY', KEYS[3], 'done', new_rows)
redis.call('HINCRBY', KEYS[3], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[3], 'think_end', think)
redis.call('HINCRBY', KEYS[3], 'missing_think_end', new_rows - think)
redis.call('HINCRBY', KEYS[3], 'truncated', trunc)
redis.call('HINCRBY', KEYS[4], 'done', new_rows)
redis.call('HINCRBY', KEYS[4], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[5], ARGV[1], tokens)
redis.call('ZADD', KEYS[6], ARGV[2], ARGV[2] .. ':' .. new_rows .. ':' .. tokens)
-- The reasoning alarm watches the job's first alarm_min_rows rows, then the running share.
local minrows = tonumber(ARGV[3])
local seen = tonumber(redis.call('HGET', KEYS[3], 'alarm_rows') or '0')
local miss = tonumber(redis.call('HGET', KEYS[3], 'alarm_missing') or '0')
for _, f in ipairs(flags) do
  if seen >= minrows then break end
  seen = seen + 1
  if f == '0' then miss = miss + 1 end
end
redis.call('HSET', KEYS[3], 'alarm_rows', seen, 'alarm_missing', miss)
local rows = tonumber(redis.call('HGET', KEYS[3], 'done'))
local missing_all = tonumber(redis.call('HGET', KEYS[3], 'missing_think_end'))
local share = tonumber(ARGV[4])
local fire = 0
if (seen >= minrows and miss >= share * minrows) or (rows >= minrows and missing_all >= share * rows) then
  fire = 1
end
return {new_rows, fire, seen, miss}
