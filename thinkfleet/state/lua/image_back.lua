-- Count one hand-back of an image prompt whose image could not be read while its store could (workers/images.py):
-- another worker may read it, but not forever.
-- KEYS: deliveries, done, dead, job (the record hash) ; ARGV: prompt_id, kind ('u': unreadable, 'm': missing),
-- worker, generation (of the job record the run is for; '' = not recorded)
-- The prompt's deliveries record (the crash counts' own: x, k, ik) gains iu / im (hand-backs of each kind) and
-- iuw / imw (the workers that saw it, each once). `producer retry` deletes the record: a retried prompt starts at 0.
-- Returns {hand-backs of the kind, distinct workers}; {0, 0} when the prompt is done or dead already, or the job
-- was purged and submitted again (another generation).
local pid = ARGV[1]
if redis.call('SISMEMBER', KEYS[2], pid) == 1 or redis.call('HEXISTS', KEYS[3], pid) == 1 then return {0, 0} end
if ARGV[4] ~= '' and redis.call('HGET', KEYS[4], 'generation') ~= '"' .. ARGV[4] .. '"' then return {0, 0} end
local rec = {x = 0, k = 0, ik = 0, error = ''}
local raw = redis.call('HGET', KEYS[1], pid)
if raw then rec = cjson.decode(raw) end
local field = 'i' .. ARGV[2]
rec[field] = tonumber(rec[field] or 0) + 1
local seen = rec[field .. 'w']
if type(seen) ~= 'table' then seen = {} end
local known = false
for _, w in ipairs(seen) do if w == ARGV[3] then known = true end end
if not known then seen[#seen + 1] = ARGV[3] end
rec[field .. 'w'] = seen
redis.call('HSET', KEYS[1], pid, cjson.encode(rec))
return {rec[field], #seen}
