-- An agentic step's executor record (workers/tool_exec.py): marked before the executor is called, its outcome
-- recorded after — each only by the run whose claim is current, so a fenced run (paused past its lease, its
-- prompt taken over) neither calls the executor nor records what it answered.
-- KEYS: claims, done, dead, job (the record hash), tool_calls
-- ARGV: mode ('mark' | 'record'), prompt_id, field ('{step}@{revision}:{calls digest}'), worker, epoch (the run's
--       claim's), generation (of the job record it ran for), value (the record's JSON: a pending mark or the
--       outcome, carrying 'epoch' and 'worker'), now
-- The fence is mark_part.lua's rule: the claim is ours at our epoch — or, Redis having lost it, the prompt is
-- neither done nor dead and the job record is of our generation: the claim becomes ours again at our epoch.
-- Returns {state, detail}:
--   {'fenced', holder}     not ours (holder: the claim's epoch@worker, 'done', 'dead' or 'generation'): nothing written
--   mark:   {'recorded', record}  the field holds a record already (another run's calls answered, or a pending mark)
--           {'marked', ''}        value (the pending mark) written: this run calls the executor
--   record: {'recorded', value}   value written over our own pending mark (or where Redis lost it)
--           {'lost', record}      the field holds another run's record: nothing written
local pid, e, worker = ARGV[2], ARGV[5], ARGV[4]
local cur = redis.call('HGET', KEYS[1], pid)
if cur then
  local claim = cjson.decode(cur)
  if claim['worker'] ~= worker or tostring(claim['epoch']) ~= e then
    return {'fenced', tostring(claim['epoch'] or '') .. '@' .. tostring(claim['worker'])}
  end
elseif redis.call('SISMEMBER', KEYS[2], pid) == 1 then
  return {'fenced', 'done'}
elseif redis.call('HEXISTS', KEYS[3], pid) == 1 then
  return {'fenced', 'dead'}
elseif ARGV[6] ~= '' and redis.call('HGET', KEYS[4], 'generation') ~= '"' .. ARGV[6] .. '"' then
  return {'fenced', 'generation'}
else
  redis.call('HSET', KEYS[1], pid, cjson.encode({worker = worker, epoch = e, at = tonumber(ARGV[8])}))
end
local found = redis.call('HGET', KEYS[5], ARGV[3])
if ARGV[1] == 'mark' then
  if found then return {'recorded', found} end
  redis.call('HSET', KEYS[5], ARGV[3], ARGV[7])
  return {'marked', ''}
end
if found then
  local rec = cjson.decode(found)
  if not (rec['pending'] and rec['worker'] == worker and tostring(rec['epoch']) == e) then
    return {'lost', found}
  end
end
redis.call('HSET', KEYS[5], ARGV[3], ARGV[7])
return {'recorded', ARGV[7]}
