-- A worker whose lease lapsed while it lived (paused past its lease, partitioned from Redis) and whose claim was
-- taken over meanwhile takes back the death claim.lua charged for that claim: it is alive, so it did not die.
-- KEYS: deliveries ; ARGV: prompt_id, worker, epoch (of the worker's own claim that was taken over)
-- Only the charge noted under that epoch (lost[epoch], claim.lua) for that worker is taken back, once: k, and ik
-- or the group split it made (g goes back unless a later death split it again). A record left with nothing
-- charged goes, as after a clean hand-back. Returns 1 when a charge was taken back, else 0.
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
local rec = cjson.decode(raw)
if type(rec['lost']) ~= 'table' then return 0 end
local charge = rec['lost'][ARGV[3]]
if type(charge) ~= 'table' or charge['w'] ~= ARGV[2] or ARGV[2] == '' then return 0 end
rec['lost'][ARGV[3]] = nil
rec['k'] = math.max(0, tonumber(rec['k']) - 1)
rec['ik'] = math.max(0, tonumber(rec['ik']) - tonumber(charge['ik'] or 0))
if charge['to'] and tonumber(rec['g'] or 0) == tonumber(charge['to']) then
  local from = tonumber(charge['from'] or 0)
  if from > 0 then rec['g'] = from else rec['g'] = nil end
end
if tonumber(rec['x']) == 0 and rec['k'] == 0 then
  redis.call('HDEL', KEYS[1], ARGV[1])
else
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(rec))
end
return 1
