-- Claim a prompt before generating it, under a fresh fencing token (epoch).
-- KEYS: done, dead, claims, deliveries, epoch_clock, revisions, job (the record hash)
-- ARGV: prompt_id, worker, claim_json, heartbeat_prefix, max_deliveries, in_group (0|1: a last-chance run that
--       joins the worker's suspect group), revision, generation (of the message's job record; '' = not recorded),
--       suspect_group_prefix (Keys.suspect_group('')), group (this worker life's group id, claim_json's 'group'
--       when in_group), group_size (the group's runs with this one), member (this run's name in the group's set),
--       host_us (the claiming worker's clock, µs)
-- Returns {state, previous claim or delivery record, epoch}; state is one of
--   done | dead      finished already: skip (no server call)
--   superseded       the message's revision is older than one requested since (producer retry), or its job
--                    record's generation is not the job's any more (producer purge + a new submit): skip it
--   busy             another live worker's run: wait for it
--   poison           its deliveries crashed too often (see below): dead-letter it
--   suspect          its last chance: not claimed; the worker claims it again with in_group = 1 once its
--                    group (the last-chance runs it runs at once) fits the record's cap g (see ledger.py)
--   new | stale | mine   ours now, under the returned epoch (stale: its previous owner died or gave it back;
--                    mine: a claim under our own name we no longer run — Redis lost our finalize, or a
--                    previous life; either may name a part, which the worker checks before generating)
--
-- The epoch is the fence: max(Redis TIME in µs, the worker's clock in µs, the job's last epoch + 1), so a later
-- claim always has a higher one, also after Redis lost writes or restarted empty (its clock goes on), or a replica
-- whose clock is behind was promoted (the worker's clock still is not). mark_part.lua and finalize.lua
-- accept only the claim's current epoch; the row carries it, and storage's committed view keeps the highest.
--
-- The delivery record {x, k, ik, g, lost, error} counts crashed deliveries: x = unexpected exceptions
-- (crashed.lua: exactly attributed), k = runs whose worker died, ik = of those, deaths alone in their suspect
-- group; g = the largest group its next last-chance run may share (absent: any). A death is charged here, once,
-- when its stale claim is taken over (a claim given back by release.lua or crashed.lua is 'settled' and charges
-- nothing), and noted in lost[claim epoch] = {w, ik, from, to} so that a worker that was only paused past its
-- lease takes it back when it shows up alive (came_back.lua). A dead worker's every run is charged, bystanders
-- too; a last-chance run's death splits its group (g = half the group's size then — from the worker life's
-- suspect-group set — and at most half the cap it ran under); only deaths alone (ik) can make a prompt poison,
-- and only two of them.
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
      -- Its worker died holding it (or lapsed: came_back.lua): charge the death once, and mark the claim settled.
      rec['k'] = tonumber(rec['k']) + 1
      local charge = {w = owner, ik = 0}
      if claim['group'] then
        local size = redis.call('SCARD', ARGV[9] .. claim['group'])
        if size == 0 then size = tonumber(claim['gs']) or 1 end  -- the set expired: what it held at the claim
        local before = tonumber(rec['g'] or 0)  -- the cap it ran under (0: none)
        if size <= 1 or before == 1 then
          charge['ik'] = 1
        else
          -- Half the group, and at least half its cap: the set may still hold a run that had just ended.
          local to = math.floor(size / 2)
          if before > 0 then to = math.min(to, math.floor(before / 2)) end
          charge['from'] = before
          charge['to'] = to
          rec['g'] = to
        end
      elseif claim['isolated'] then
        charge['ik'] = 1  -- a claim of a worker from before suspect groups: run alone
      end
      rec['ik'] = tonumber(rec['ik']) + charge['ik']
      if claim['epoch'] then
        if type(rec['lost']) ~= 'table' then rec['lost'] = {} end
        rec['lost'][tostring(claim['epoch'])] = charge
      end
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
if x + k + 1 >= max then
  local cap = tonumber(rec['g'] or 0)
  if ARGV[6] ~= '1' or (cap > 0 and tonumber(ARGV[11]) > cap) then return {'suspect', cjson.encode(rec), ''} end
end
local t = redis.call('TIME')
local epoch = tonumber(t[1]) * 1000000 + tonumber(t[2])
-- Nor below the claiming worker's own clock (ARGV[13], µs): a replica promoted with its clock behind that also
-- lost the last epoch-clock writes would otherwise mint epochs below rows storage already holds.
local host = tonumber(ARGV[13] or '0') or 0
if host > epoch then epoch = host end
local last = tonumber(redis.call('GET', KEYS[5]) or '0')
if epoch <= last then epoch = last + 1 end
-- As a decimal string: cjson would print a 16-digit number with 14 significant digits.
local e = string.format('%.0f', epoch)
redis.call('SET', KEYS[5], e)
local claim = cjson.decode(ARGV[3])
claim['epoch'] = e
redis.call('HSET', KEYS[3], ARGV[1], cjson.encode(claim))
if ARGV[6] == '1' then
  -- In the worker's group until the run ends (Ledger.leave_group): the set's size at a death is the group's.
  redis.call('SADD', ARGV[9] .. ARGV[10], ARGV[12])
  redis.call('EXPIRE', ARGV[9] .. ARGV[10], 86400)
end
return {state, cur or '', e}
