-- Give a claim back cleanly (the message is handed back: server down, draining, storage down).
-- KEYS: claims, deliveries ; ARGV: prompt_id, worker
-- A claim that names a part keeps it, with no owner: whoever claims next checks whether that part
-- committed and finalizes from it instead of generating a second row (the ambiguous commit).
-- The delivery counted by claim.lua is given back: a clean hand-back is not a crash.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local claim = cjson.decode(cur)
if claim['worker'] ~= ARGV[2] then return 0 end
if claim['part'] and claim['part'] ~= cjson.null then
  claim['worker'] = ''
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(claim))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw then
  local rec = cjson.decode(raw)
  if tonumber(rec['n']) > 0 then rec['n'] = tonumber(rec['n']) - 1 end
  redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(rec))
end
return 1
