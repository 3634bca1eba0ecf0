-- Move up to ARGV[1] parked messages back onto the queue (behind what is queued, in their order).
-- KEYS: parked, queue ; returns how many are still parked.
for _ = 1, tonumber(ARGV[1]) do
  if not redis.call('RPOPLPUSH', KEYS[1], KEYS[2]) then break end
end
return redis.call('LLEN', KEYS[1])
