-- Just before a part is written: each claim that is still ours, at our epoch, records the part's path.
-- KEYS: claims, done, dead, job (the record hash), counters (its 'fenced' counts the rows refused here)
-- ARGV: worker, part, now, then per row: prompt_id, epoch (the claim's), generation (of the job record it ran for)
-- Returns the rows that are no longer ours, as {prompt_id, what holds it now} pairs flattened: the holder's
-- epoch, 'done' or 'dead'. Those rows must not be written (a worker paused past its lease: another run took
-- the prompt over). A claim Redis lost (restarted empty, rolled back) while the prompt is neither done nor dead
-- is held by nobody: it becomes ours again at our epoch (any later claim gets a higher one) — unless the job was
-- purged and submitted anew meanwhile (another generation: 'generation').
local fenced = {}
for i = 4, #ARGV, 3 do
  local pid, e, gen = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local cur = redis.call('HGET', KEYS[1], pid)
  local claim, holder = nil, nil
  if cur then
    claim = cjson.decode(cur)
    if claim['worker'] ~= ARGV[1] or tostring(claim['epoch']) ~= e then
      holder = tostring(claim['epoch'] or '') .. '@' .. tostring(claim['worker'])
    end
  elseif redis.call('SISMEMBER', KEYS[2], pid) == 1 then
    holder = 'done'
  elseif redis.call('HEXISTS', KEYS[3], pid) == 1 then
    holder = 'dead'
  elseif gen ~= '' and redis.call('HGET', KEYS[4], 'generation') ~= '"' .. gen .. '"' then
    holder = 'generation'
  else
    claim = {worker = ARGV[1], epoch = e, at = tonumber(ARGV[3])}
  end
  if holder then
    fenced[#fenced + 1] = pid
    fenced[#fenced + 1] = holder
  else
    claim['part'] = ARGV[2]
    redis.call('HSET', KEYS[1], pid, cjson.encode(claim))
  end
end
if #fenced > 0 then redis.call('HINCRBY', KEYS[5], 'fenced', #fenced / 2) end
return fenced
