-- Claim a prompt before generating it.
-- KEYS: done, dead, claims, deliveries
-- ARGV: prompt_id, worker, claim_json, heartbeat_prefix, max_deliveries, isolated (0|1)
-- Returns {state, previous claim or delivery record}; state is one of
--   done | dead      finished already: skip (no server call)
--   mine             our own claim (a redelivery to the same process)
--   busy             another live worker's run: wait for it
--   poison           max_deliveries earlier deliveries crashed: dead-letter it
--   suspect          one more crash makes it poison: not claimed; the worker claims it again with
--                    isolated = 1 once it runs no other last-chance prompt (see ledger.py)
--   new | stale      ours now (stale: its previous owner died; the claim may name a part)
if redis.call('SISMEMBER', KEYS[1], ARGV[1]) == 1 then return {'done', ''} end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then return {'dead', ''} end
local cur = redis.call('HGET', KEYS[3], ARGV[1])
local state = 'new'
if cur then
  local owner = cjson.decode(cur)['worker']
  if owner == ARGV[2] then return {'mine', cur} end
  if owner ~= '' and redis.call('EXISTS', ARGV[4] .. owner) == 1 then return {'busy', cur} end
  state = 'stale'
end
-- Every delivery that starts a run counts; a clean hand-back gives the count back (release.lua),
-- so what remains counts deliveries that crashed (an exception, or a worker killed mid-run).
local rec = {n = 0, error = ''}
local raw = redis.call('HGET', KEYS[4], ARGV[1])
if raw then rec = cjson.decode(raw) end
if tonumber(rec['n']) >= tonumber(ARGV[5]) then return {'poison', cjson.encode(rec)} end
if ARGV[6] ~= '1' and tonumber(rec['n']) + 1 >= tonumber(ARGV[5]) then return {'suspect', cjson.encode(rec)} end
rec['n'] = tonumber(rec['n']) + 1
if state == 'stale' and rec['error'] == '' then rec['error'] = 'WorkerLost: its worker died mid-run' end
redis.call('HSET', KEYS[4], ARGV[1], cjson.encode(rec))
redis.call('HSET', KEYS[3], ARGV[1], ARGV[3])
return {state, cur or ''}
