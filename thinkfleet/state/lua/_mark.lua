-- write_mark(marks, worker, mark): record a worker's finalize mark (finalize.lua, dead_letter.lua).
-- mark is 'nonce:seq:prev': the worker process's nonce, this write's sequence number, and the highest sequence number
-- of its own writes to the job that Redis answered before (0: none). marks[worker] becomes 'nonce:seq' unless a later
-- write of the same process is there already (concurrent calls may land out of order). When the mark found there is
-- behind prev — or another process's, or gone — while prev > 0, Redis lost writes of this worker (a rollback, a
-- replica promoted behind): marks[worker .. '|lost'] = '1', which Ledger.lost_finalizes reads and Ledger.remark clears
-- once the lost writes were made again. A later write does not hide the loss, as comparing the latest mark alone did.
local function write_mark(marks, worker, mark)
  local nonce, seq, prev = string.match(mark, '^([^:]+):(%d+):(%d+)$')
  if not nonce then  -- 'nonce:seq' from a caller without the check
    redis.call('HSET', marks, worker, mark)
    return
  end
  seq, prev = tonumber(seq), tonumber(prev)
  local cur = redis.call('HGET', marks, worker)
  local cur_nonce, cur_seq = nil, 0
  if cur then
    local n, s = string.match(cur, '^([^:]+):(%d+)')
    if n then cur_nonce, cur_seq = n, tonumber(s) end
  end
  local ours = cur_nonce == nonce
  if prev > 0 and (not ours or cur_seq < prev) then
    redis.call('HSET', marks, worker .. '|lost', '1')
  end
  if not ours or cur_seq < seq then
    redis.call('HSET', marks, worker, nonce .. ':' .. seq)
  end
end
