-- An operator's move of a job's lifecycle state, checked and made in one step (producer pause/resume/cancel):
-- a check-then-set from Python let a pause that read "active" overwrite a cancel made in between (the job came
-- back paused, its cancel forgotten).
-- KEYS: state (STRING; absent = active), job (the record hash), jobs (SET of job names)
-- ARGV: job, the new state ('paused', 'cancelled', or 'active': the key deleted), then the states it may leave
-- Returns {'ok', previous} or {'refused', previous} (the job is in a state this move may not leave), or
-- {'unknown', ''} (no record and not in the job set: nothing to move, and no state key is made for it).
if redis.call('EXISTS', KEYS[2]) == 0 and redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 0 then
  return {'unknown', ''}
end
local previous = redis.call('GET', KEYS[1]) or 'active'
local allowed = false
for i = 3, #ARGV do
  if ARGV[i] == previous then allowed = true end
end
if not allowed then return {'refused', previous} end
if ARGV[2] == 'active' then
  redis.call('DEL', KEYS[1])
else
  redis.call('SET', KEYS[1], ARGV[2])
end
return {'ok', previous}
