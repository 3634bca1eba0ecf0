-- At start: a previous life's claim loses its owner (and keeps its part).
-- KEYS: claims ; ARGV: prompt_id, the claim as read, the claim with no owner
if redis.call('HGET', KEYS[1], ARGV[1]) == ARGV[2] then
  redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
  return 1
end
return 0
