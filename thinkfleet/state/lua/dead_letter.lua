-- Record a permanent failure (exactly once per prompt: a second dead letter changes no counter).
-- KEYS: dead, claims, counters, dataset_counters, deliveries, done ; ARGV: prompt_id, record_json
if redis.call('SISMEMBER', KEYS[6], ARGV[1]) == 1 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[5], ARGV[1])
if redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[3], 'dead', 1)
redis.call('HINCRBY', KEYS[4], 'dead', 1)
return 1
