-- uses: _mark
-- Record a permanent failure (exactly once per prompt: a second dead letter changes no counter).
-- KEYS: dead, claims, counters, dataset_counters, deliveries, done, finalize_marks, job (the record hash), revisions
-- ARGV: prompt_id, record_json, worker, epoch (of the caller's claim; '' = refused before any claim), the caller's
--       mark ('nonce:seq:prev', _mark.lua's write_mark: a worker that finds it behind knows Redis lost writes),
--       generation (of the job record the message was made for; '' = not recorded), revision (of the message)
-- Returns 1 recorded, 0 already dead or done, -1 fenced: the prompt's claim is another run's now (the caller was
-- paused past its lease), which must not be ended from here (counted in the job's 'fenced' counter); -2 the job
-- record is gone or another generation (producer purge, perhaps a new submit, while the message ran or waited):
-- nothing of the job is written — a straggler must not bring a purged job's keys back; -3 the message is of a lower
-- revision than `producer retry` asked for since (a leftover copy): the prompt is that revision's run's to end, and a
-- dead letter of the old message would be resent by `retry --error-class` as the old revision — refused by every
-- claim, so the prompt would never end.
if ARGV[6] ~= '' and redis.call('HGET', KEYS[8], 'generation') ~= '"' .. ARGV[6] .. '"' then return -2 end
write_mark(KEYS[7], ARGV[3], ARGV[5])
if redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 1 then return 0 end
if (tonumber(ARGV[7]) or 0) < tonumber(redis.call('HGET', KEYS[9], ARGV[1]) or '0') then return -3 end
if ARGV[4] ~= '' then
  local cur = redis.call('HGET', KEYS[2], ARGV[1])
  if cur then
    local claim = cjson.decode(cur)
    if claim['worker'] ~= ARGV[3] or tostring(claim['epoch']) ~= ARGV[4] then
      redis.call('HINCRBY', KEYS[3], 'fenced', 1)
      return -1
    end
  end
end
-- A claim naming a part stays, ownerless and settled (as release.lua and cancel.lua keep it): that run may have
-- committed its row, and the claim after `producer retry` finalizes from the part instead of generating a second row.
local held = redis.call('HGET', KEYS[2], ARGV[1])
local claim = held and cjson.decode(held)
if claim and claim['part'] and claim['part'] ~= cjson.null then
  claim['worker'] = ''
  claim['settled'] = true
  redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(claim))
elseif claim then
  redis.call('HDEL', KEYS[2], ARGV[1])
end
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], 'dead', 1)
redis.call('HINCRBY', KEYS[4], 'dead', 1)
return 1
