-- Give a claim back: the message is handed back to the queue.
-- KEYS: claims, deliveries, done, dead, job (the record hash) ; ARGV: prompt_id, worker, error ('' for a clean
-- hand-back), epoch (the caller's claim; a claim under another epoch is another run's and is left alone),
-- generation (of the job record the run is for; '' = not recorded: a crash of a purged job's run — its record gone
-- or another generation — counts nothing, so a straggler brings none of its keys back)
-- A claim that names a part keeps it, with no owner and settled (no death to charge): whoever claims
-- next checks whether that part committed and finalizes from it instead of generating a second row
-- (the ambiguous commit). A claim with no part just goes.
-- A clean hand-back (server down, draining, storage down) counts nothing and returns 0. A crash (an
-- unexpected exception, ARGV[3] = its summary) is counted (x) with its error; returns the exceptions
-- counted so far — or 0 when the prompt is already done or dead (nothing to count).
local finished = redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 or redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and not finished then
  local claim = cjson.decode(cur)
  if claim['worker'] == ARGV[2] and (ARGV[4] == nil or ARGV[4] == '' or tostring(claim['epoch']) == ARGV[4]) then
    if claim['part'] and claim['part'] ~= cjson.null then
      claim['worker'] = ''
      claim['settled'] = true
      redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(claim))
    else
      redis.call('HDEL', KEYS[1], ARGV[1])
    end
  end
end
if ARGV[3] == '' or finished then return 0 end
if ARGV[5] ~= '' and redis.call('HGET', KEYS[5], 'generation') ~= '"' .. ARGV[5] .. '"' then return 0 end
local rec = {x = 0, k = 0, ik = 0, error = ''}
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw then rec = cjson.decode(raw) end
rec['x'] = tonumber(rec['x']) + 1
rec['error'] = ARGV[3]
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(rec))
return rec['x']
