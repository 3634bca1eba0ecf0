-- A delivery ended in an unexpected exception: it stays counted (poison detection) with its error.
-- KEYS: claims, deliveries, done, dead ; ARGV: prompt_id, worker, claimed (0|1), error
-- claimed = 1: claim.lua counted this delivery already; the claim is given up like a release
-- (a named part is kept, ownerless). claimed = 0: the crash came before a claim; count it here.
-- Returns the crashed deliveries so far (0 when the prompt is already done or dead).
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then return 0 end
local rec = {n = 0, error = ''}
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw then rec = cjson.decode(raw) end
local n = tonumber(rec['n'])
if ARGV[3] == '1' then
  local cur = redis.call('HGET', KEYS[1], ARGV[1])
  if cur then
    local claim = cjson.decode(cur)
    if claim['worker'] == ARGV[2] then
      if claim['part'] and claim['part'] ~= cjson.null then
        claim['worker'] = ''
        redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(claim))
      else
        redis.call('HDEL', KEYS[1], ARGV[1])
      end
    end
  end
  if n < 1 then n = 1 end
else
  n = n + 1
end
rec['n'] = n
rec['error'] = ARGV[4]
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(rec))
return n
