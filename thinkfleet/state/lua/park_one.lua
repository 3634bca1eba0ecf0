-- A worker holding a message of a paused job parks it, only while the job is still paused (a resume
-- that already moved the parked list back would strand it). KEYS: job state, parked ; ARGV: message
if redis.call('GET', KEYS[1]) ~= 'paused' then return 0 end
redis.call('LPUSH', KEYS[2], ARGV[1])
return 1
