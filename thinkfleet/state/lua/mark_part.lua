-- Just before a part is written: each claim that is still ours, at our epoch, records the part's path.
-- KEYS: claims, done, dead, job (the record hash), counters (its 'fenced' counts the rows refused here but a purged
--       job's, 'generation'), revisions
-- ARGV: worker, part, now, then per row: prompt_id, epoch (the claim's), generation (of the job record it ran for),
--       revision (of the run's message)
-- Returns the rows that are no longer ours, as {prompt_id, what holds it now} pairs flattened: the holder's
-- epoch, 'done', 'dead', or 'revision N' (producer retry asked for revision N since: a run of a lower one is
-- fenced whatever its claim says, as claim.lua refuses to start one; our own claim on it goes). Those rows must
-- not be written (a worker paused past its lease: another run took the prompt over, or the operator asked for a
-- new revision). A claim Redis lost (restarted empty, rolled back) while the prompt is neither done nor dead
-- is held by nobody: it becomes ours again at our epoch (any later claim gets a higher one) — unless the job was
-- purged and submitted anew meanwhile (another generation: 'generation').
local fenced = {}
local counted = 0
for i = 4, #ARGV, 4 do
  local pid, e, gen = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local wanted = tonumber(redis.call('HGET', KEYS[6], pid) or '0')
  local cur = redis.call('HGET', KEYS[1], pid)
  local claim, holder = nil, nil
  if (tonumber(ARGV[i + 3]) or 0) < wanted then
    holder = 'revision ' .. wanted
    -- our own claim goes with it (no row of ours will be written): the new revision's run must not wait on it
    local mine = cur and cjson.decode(cur)
    if mine and mine['worker'] == ARGV[1] and tostring(mine['epoch']) == e then redis.call('HDEL', KEYS[1], pid) end
  elseif cur then
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
    -- a purged job's straggler ('generation') is not counted: its counters would bring the purged job's keys back
    if holder ~= 'generation' then counted = counted + 1 end
  else
    claim['part'] = ARGV[2]
    redis.call('HSET', KEYS[1], pid, cjson.encode(claim))
  end
end
if counted > 0 then redis.call('HINCRBY', KEYS[5], 'fenced', counted) end
return fenced
