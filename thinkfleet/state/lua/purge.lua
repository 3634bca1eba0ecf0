-- producer purge, its first and deciding step: the job's record and its name go with every key of the job whose
-- name is fixed, in one call. From here on every worker script refuses the job's stragglers (claim, mark_part,
-- finalize, release, dead_letter check the record's generation, which is gone): a run that was in flight writes
-- nothing back, so the sweep of the job's other keys (per-dataset counters, staging; by SCAN, after this) finds
-- what it deletes and nothing re-made behind it.
-- KEYS: jobs (SET of job names), then the job's keys to delete: its record first
-- ARGV: job
-- Returns how many keys existed and went.
redis.call('SREM', KEYS[1], ARGV[1])
local gone = 0
for i = 2, #KEYS do
  gone = gone + redis.call('DEL', KEYS[i])
end
return gone
