-- producer cancel: end a slice of a cancelled job's parked messages. Each message leaves the parked list only in
-- the same atomic step that dead-letters its prompt `cancelled` — or because its prompt is finished already — so a
-- cancel racing workers (live or dead) never drops a prompt.
-- KEYS: parked, dead, claims, counters, deliveries, done, revisions, then the dataset counters each message names by
--       index
-- ARGV: heartbeat key prefix, then per message: the message as parked, prompt_id, the dead-letter record (JSON),
--       1-based index of its dataset counters key after KEYS[7], the message's revision
-- Returns one state per message, in order:
--   dead      dead-lettered now (the only state that is a new dead letter; the counters follow);
--   finished  its prompt is done or dead already: this copy leaves the parked list, nothing else changes;
--   superseded  the message is of a lower revision than `producer retry` asked for since (a leftover copy): it leaves
--             the parked list and is not the prompt's dead letter — `retry --error-class cancelled` would resend
--             the old revision, which every claim refuses (the prompt never ended);
--   gone      the message is not parked any more (producer resume moved it back meanwhile): nothing changes;
--   live      a live worker (its heartbeat exists) holds the prompt's claim: the message stays parked. That run
--             ends the prompt (stored, or dead-lettered `cancelled` when the worker's cancel watch aborts it); if it
--             dies first, the next cancel finds its claim dead.
-- A claim a dead run left goes with the dead letter (epochs are not compared: the producer holds no claim, and only
-- a live run's claim is kept) — unless it names a part: that run may have committed its row, so the claim stays,
-- ownerless and settled (no death is charged), and the claim after `producer retry --error-class cancelled`
-- finalizes from that part instead of generating a second row.
local states = {}
for i = 2, #ARGV, 5 do
  local raw, pid, record = ARGV[i], ARGV[i + 1], ARGV[i + 2]
  local state
  local cur = redis.call('HGET', KEYS[3], pid)
  local claim = cur and cjson.decode(cur)
  local owner = claim and claim['worker'] or ''
  if owner ~= '' and redis.call('EXISTS', ARGV[1] .. owner) == 1
      and redis.call('SISMEMBER', KEYS[6], pid) == 0 and redis.call('HEXISTS', KEYS[2], pid) == 0 then
    state = 'live'
  elseif redis.call('LREM', KEYS[1], 1, raw) == 0 then
    state = 'gone'
  elseif redis.call('SISMEMBER', KEYS[6], pid) == 1 or redis.call('HEXISTS', KEYS[2], pid) == 1 then
    state = 'finished'
  elseif (tonumber(ARGV[i + 4]) or 0) < tonumber(redis.call('HGET', KEYS[7], pid) or '0') then
    state = 'superseded'
  else
    if claim and claim['part'] and claim['part'] ~= cjson.null then
      claim['worker'] = ''
      claim['settled'] = true
      redis.call('HSET', KEYS[3], pid, cjson.encode(claim))
    elseif claim then
      redis.call('HDEL', KEYS[3], pid)
    end
    redis.call('HDEL', KEYS[5], pid)
    redis.call('HSET', KEYS[2], pid, record)
    redis.call('HINCRBY', KEYS[4], 'dead', 1)
    redis.call('HINCRBY', KEYS[7 + tonumber(ARGV[i + 3])], 'dead', 1)
    state = 'dead'
  end
  states[#states + 1] = state
end
return states
