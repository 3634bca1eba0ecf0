-- Claim a prompt before generating it, under a fresh fencing token (epoch).
-- KEYS: done, dead, claims, deliveries, epoch_clock, revisions, job (the record hash)
-- ARGV: prompt_id, worker, claim_json, heartbeat_prefix, max_deliveries, isolated (0|1), revision,
--       generation (of the message's job record; '' = not recorded)
-- Returns {state, previous claim or delivery record, epoch}; state is one of
--   done | dead      finished already: skip (no server call)
--   superseded       the message's revision is older than one requested since (producer retry), or its job
--                    record's generation is not the job's any more (producer purge + a new submit): skip it
--   busy             another live worker's run: wait for it
--   poison           its deliveries crashed too often (see below): dead-letter it
--   suspect          its last chance: not claimed; the worker claims it again with isolated = 1
--                    once it runs no other last-chance prompt (see ledger.py)
--   new | stale | mine   ours now, under the returned epoch (stale: its previous owner died or gave it back;
--                    mine: a claim under our own name we no longer run — Redis lost our finalize, or a
--                    previous life; either may name a part, which the worker checks before generating)
--
-- The epoch is the fence: max(Redis TIME in µs, the job's last epoch + 1), so a later claim always has a higher
-- one, also after Redis lost writes or restarted empty (its clock goes on). mark_part.lua and finalize.lua
-- accept only the claim's current epoch; the row carries it, and storage's committed view keeps the highest.
--
-- The delivery record {x, k, ik, error} counts crashed deliveries: x = unexpected exceptions
-- (crashed.lua: exactly attributed), k = runs whose worker died, ik = of those, runs that were
-- isolated. A death is charged here, once, when its stale claim is taken over (a claim given back by
-- release.lua or crashed.lua is 'settled' and charges nothing). A dead worker's every run is charged,
-- bystanders too — only isolated deaths (ik) can make a prompt poison, and only two of them.
if ARGV[8] and ARGV[8] ~= '' and redis.call('HGET', KEYS[7], 'generation') ~= '"' .. ARGV[8] .. '"' then
  return {'superseded', 'generation', ''}
end
local rev = tonumber(ARGV[7]) or 0
local wanted = tonumber(redis.call('HGET', KEYS[6], ARGV[1]) or '0')
if rev < wanted then return {'superseded', tostring(wanted), ''} end
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return {'done', '', ''} end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'dead', '', ''} end
if rev > wanted then redis.call('HSET', KEYS[6], ARGV[1], rev) end
local cur = redis.call('HGET', KEYS[3], ARGV[1])
local state = 'new'
local rec = {x = 0, k = 0, ik = 0, error = ''}
local raw = redis.call('HGET', KEYS[4], ARGV[1])
if raw then rec = cjson.decode(raw) end
if cur then
  local claim = cjson.decode(cur)
  local owner = claim['worker']
  if owner == ARGV[2] then
    state = 'mine'
  else
    if owner ~= '' and redis.call('EXISTS', ARGV[4] .. owner) == 1 then return {'busy', cur, ''} end
    state = 'stale'
    if not claim['settled'] then
      -- Its worker died holding it: charge the death once, and mark the claim settled.
      rec['k'] = tonumber(rec['k']) + 1
      if claim['isolated'] then rec['ik'] = tonumber(rec['ik']) + 1 end
      if rec['error'] == '' then rec['error'] = 'WorkerLost: its worker died mid-run' end
      redis.call('HSET', KEYS[4], ARGV[1], cjson.encode(rec))
      claim['worker'] = ''
      claim['settled'] = true
      cur = cjson.encode(claim)
      redis.call('HSET', KEYS[3], ARGV[1], cur)
    end
  end
end
local max = tonumber(ARGV[5])
local x, k, ik = tonumber(rec['x']), tonumber(rec['k']), tonumber(rec['ik'])
if x >= max or (x + k >= max and ik >= 2) then return {'poison', cjson.encode(rec), ''} end
if ARGV[6] ~= '1' and x + k + 1 >= max then return {'suspect', cjson.encode(rec), ''} end
local t = redis.call('TIME')
local epoch = tonumber(t[1]) * 1000000 + tonumber(t[2])
local last = tonumber(redis.call('GET', KEYS[5]) or '0')
if epoch <= last then epoch = last + 1 end
-- As a decimal string: cjson would print a 16-digit number with 14 significant digits.
local e = string.format('%.0f', epoch)
redis.call('SET', KEYS[5], e)
local claim = cjson.decode(ARGV[3])
claim['epoch'] = e
redis.call('HSET', KEYS[3], ARGV[1], cjson.encode(claim))
return {state, cur or '', e}
