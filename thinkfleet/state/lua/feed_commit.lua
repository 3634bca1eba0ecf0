-- A reader of the job's commit log (storage/feed.py) registers, or records how far its output is durable, and the
-- log is trimmed behind the slowest registered reader: every entry below the lowest position goes (XTRIM MINID,
-- exact: the entry at the lowest position itself stays, which costs one entry). A position of another incarnation
-- of the log (the reader's cursor names a log that was lost since) means nothing here: it is recorded as '0-0',
-- which holds the whole log until that reader commits a position of this one. Nothing is written for a job whose
-- record is gone (purged: its keys must not come back).
-- KEYS: feed_readers, feed, feed_log, job (the record hash)
-- ARGV: reader, the cursor's log id, the cursor's seq, mode ('register': only a reader not registered yet is
--       recorded, nothing trimmed; 'commit')
-- Returns the entries trimmed; the highest of them goes into feed_log's 'trimmed'.
if redis.call('EXISTS', KEYS[4]) == 0 then return 0 end
local function id_of(s)
  local ms, n = string.match(s, '^(%d+)-(%d+)$')
  return tonumber(ms) or 0, tonumber(n) or 0
end
local function below(a, b)
  local am, an = id_of(a)
  local bm, bn = id_of(b)
  return am < bm or (am == bm and an < bn)
end
local pos = ARGV[3]
if redis.call('HGET', KEYS[3], 'id') ~= ARGV[2] then pos = '0-0' end
if ARGV[4] == 'register' then
  redis.call('HSETNX', KEYS[1], ARGV[1], pos)
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], pos)
local low = nil
for _, v in ipairs(redis.call('HVALS', KEYS[1])) do
  if low == nil or below(v, low) then low = v end
end
if low == nil or low == '0-0' then return 0 end
-- the highest entry that goes, kept in the log's record ('trimmed': a stream's own max-deleted-entry-id does not
-- count trims), where a reader whose position is below it finds it lost entries
local last = redis.call('XREVRANGE', KEYS[2], '(' .. low, '-', 'COUNT', 1)
if #last == 0 then return 0 end
redis.call('HSET', KEYS[3], 'trimmed', last[1][1])
return redis.call('XTRIM', KEYS[2], 'MINID', low)
