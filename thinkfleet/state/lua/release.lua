-- Give a claim back cleanly (the message is handed back: server down, draining, storage down).
-- KEYS: claims ; ARGV: prompt_id, worker
-- A claim that names a part keeps it, with no owner and settled (no death to charge): whoever claims
-- next checks whether that part committed and finalizes from it instead of generating a second row
-- (the ambiguous commit). A claim with no part just goes.
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if not cur then return 0 end
local claim = cjson.decode(cur)
if claim['worker'] ~= ARGV[2] then return 0 end
if claim['part'] and claim['part'] ~= cjson.null then
  claim['worker'] = ''
  claim['settled'] = true
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(claim))
else
  redis.call('HDEL', KEYS[1], ARGV[1])
end
return 1
