-- A delivery ended in an unexpected exception: count it (x) with its error, give up our claim.
-- KEYS: claims, deliveries, done, dead ; ARGV: prompt_id, worker, error
-- The claim goes like a release (a named part is kept, ownerless and settled). Returns the exceptions
-- counted so far (0 when the prompt is already done or dead: nothing to count).
if redis.call('SISMEMBER', KEYS[3], ARGV[1]) == 1 then return 0 end
if redis.call('HEXISTS', KEYS[4], ARGV[1]) == 1 then return 0 end
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur then
  local claim = cjson.decode(cur)
  if claim['worker'] == ARGV[2] then
    if claim['part'] and claim['part'] ~= cjson.null then
      claim['worker'] = ''
      claim['settled'] = true
      redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(claim))
    else
      redis.call('HDEL', KEYS[1], ARGV[1])
    end
  end
end
local rec = {x = 0, k = 0, ik = 0, error = ''}
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw then rec = cjson.decode(raw) end
rec['x'] = tonumber(rec['x']) + 1
rec['error'] = ARGV[3]
redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(rec))
return rec['x']
