-- uses: _mark _offer
-- Mark committed rows done (the part holding them is durable); for a multi-turn job (workers/turns.py),
-- each newly done row also records the model's answer and enqueues its conversation's next turn in the
-- same atomic step (exactly once: only the call that moves the row into done does it, so a recovery
-- that finalizes an orphan part enqueues it if nobody did).
-- Fenced: a row is finalized only while its claim is still the caller's at the caller's epoch (claim.lua) — or,
-- when Redis lost the claim, while nobody else finished the prompt. Any other row is *fenced*: it changes no
-- counter but the job's 'fenced' one, no answer record, no next turn, and is returned with what holds the prompt
-- now. The epoch of the row made committed is recorded (committed_epochs); a retried finalize of that very row is
-- not fenced.
-- A next turn already done or dead (a re-run of turn i re-derives it) leaves done/dead before its message lands,
-- or the claim would skip it; so do the later turns a chain that now ends here no longer derives (drop), which
-- also leave the job's prompts (submitted). The counters follow as requeue.lua corrects them (the next turn is
-- of the same dataset).
-- Revisions are fenced like epochs: a row of a lower revision than the one requested since (producer retry
-- --truncated, Keys.revisions) is fenced ('revision N') whatever its claim says (our own claim on it goes). A next
-- turn enqueued at a revision above the one requested for it (a re-derivation) raises it in the same step: a
-- leftover copy of its older message (rendered from the turn as it was) is superseded, not run. A dropped turn's
-- revision is raised by one in the step that drops it, for the same reason; a chain that derives it again later
-- enqueues it at that revision at least (workers/turns.py reads it).
-- Host affinity (thinkfleet/broker/affinity.py): with the offers ZSET after answers, the queue is the caller's own
-- host list; a next turn is pushed onto its far end (the host list is first in, first out, so its oldest offer is
-- the one popped and the one a sweep looks at) and its offer time recorded, on Redis's clock, in the same step.
-- Every newly done row of a turn ≥ 1 that says how much of its prompt its previous turn's server already computed
-- (prefix_reusable) and how much the server found cached adds both (cached capped at reusable) to the job's counters.
-- Each answer recorded also records its conversation's chain state (Keys.chain_state: [prompt id, '>next' or
-- '=reason']), a few bytes that retry reads instead of every answer: only a call that moves a row into done writes
-- it, so it is the chain's last finalized link (a fenced or superseded run writes nothing). Where the chains stand
-- is kept beside it as it changes: the counters' chains_complete and chains_ended:{kind} (the reason up to its
-- first ':'), and the set of conversations whose chain goes on (chain_waiting): status and wait read those.
-- The commit log (Keys.feed, storage/feed.py): each row moved into done appends one entry in the same step —
-- prompt_id, revision, epoch, the part's URI and the row's index in it, and when the prompt had a committed row
-- before (a later revision: producer retry --truncated), 'replaces' = that row's 'revision:epoch'
-- (committed_revisions keeps a committed row's revision when it is above 0) — capped at about feed_max_len entries
-- (a job nobody reads stays bounded; Keys.feed_log 'trimmed' names the highest entry trimmed). The log's
-- incarnation (Keys.feed_log 'id', Redis time in µs) is made with its first entry: a log lost with Redis gets a new
-- one, which readers' cursors no longer name.
-- KEYS: done, claims, counters, dataset_counters, worker_counters, timeline, deliveries, dead, committed_epochs,
--       job (the record hash), and only when a row carries an answer or a next turn: queue, prompts,
--       prompt_dataset, answers, chain_state, chain_waiting, [offers]; last of all, always: revisions,
--       finalize_marks, feed, feed_log, committed_revisions
-- ARGV: worker, alarm_min_rows, alarm_missing_share, dataset, then per row: prompt_id, tokens, think_end
--       ('1' closed reasoning, '0' expected to and did not, '2' not expected to reason: not watched by the alarm),
--       truncated ('1' or '0', then ':' and the row's quality flags, comma-separated, when it has any:
--       counted per dataset as 'flag:NAME'), answer ('' = none), next_prompt_id ('' = none), next_content_hash, next_message,
--       drop (JSON list of turn prompt ids, '' = none), the claim's epoch, the row's own epoch (an orphan's part
--       row was written under an earlier claim), the generation of the job record it ran for ('' = not recorded),
--       the row's revision, the next turn's revision (its message's; 0 = none), the row's prefix_reusable tokens
--       ('' = unknown), its cached tokens ('' = not reported), the URI of the part holding the row, the row's index
--       in it ('-1' = not known: the feed finds it by prompt id);
--       last of all, always: the feed's cap in entries (0 = none), the caller's finalize mark ('nonce:seq:prev',
--       _mark.lua's write_mark: a worker that later finds an older mark there knows Redis lost finalizes of its own,
--       Ledger.lost_finalizes)
-- Returns {new rows, alarm fires, alarm rows seen, of them missing, {fenced prompt_id, holder, ...}, next turns
--   offered on the host list by this call} — the last is what the worker counts as offered (AFFINITY): only the
--   call that moves a row into done pushes its next turn, so a retried or replayed finalize of it offers nothing
--   and counts nothing.
local last = #KEYS - 3
local REVISIONS, MARKS = KEYS[last - 1], KEYS[last]
local FEED, FEED_LOG, COMMITTED_REVISIONS = KEYS[last + 1], KEYS[last + 2], KEYS[last + 3]
local feed_max_len = tonumber(ARGV[#ARGV - 1]) or 0
local new_rows, tokens, think, trunc, expected, offered = 0, 0, 0, 0, 0, 0
local flag_counts = {}
local undone, undead = 0, 0
local function take_out(id)
  undone = undone + redis.call('SREM', KEYS[1], id)
  undead = undead + redis.call('HDEL', KEYS[8], id)
  redis.call('HDEL', KEYS[7], id)
end
local flags = {}
local fenced = {}
-- a chain state counted in (n = 1) or out (n = -1) of where the chains stand
local function chain_count(conv, link, n)
  if string.sub(link, 1, 1) == '>' then
    if n > 0 then redis.call('SADD', KEYS[16], conv) else redis.call('SREM', KEYS[16], conv) end
    return
  end
  local reason = string.sub(link, 2)
  local field = 'chains_complete'
  if reason ~= 'complete' then field = 'chains_ended:' .. string.match(reason, '^[^:]*') end
  redis.call('HINCRBY', KEYS[3], field, n)
end
-- the conversation's chain state after this answer (thinkfleet/chain_end.py's record_link, in a few bytes)
local function chain_state(pid, answer, next_id)
  local conv = string.match(pid, '^(.+)/t%d+s%d+$') or string.match(pid, '^(.+)/t%d+$')
  if not conv then return end
  local link
  if next_id ~= '' then
    link = '>' .. next_id
  else
    local rec = cjson.decode(answer)
    if type(rec) == 'table' and rec['chain_end'] and rec['chain_end'] ~= cjson.null then
      link = '=' .. tostring(rec['chain_end'])
    elseif type(rec) == 'table' and type(rec['next']) == 'string' and rec['next'] ~= '' then
      link = '>' .. rec['next']
    else
      link = '=complete'
    end
  end
  local old = redis.call('HGET', KEYS[15], conv)
  if old then chain_count(conv, cjson.decode(old)[2], -1) end
  chain_count(conv, link, 1)
  redis.call('HSET', KEYS[15], conv, cjson.encode({pid, link}))
end
-- nil when the row may be finalized, else what holds the prompt now (or 'ours' when this row is already it)
local function holder(pid, e, row_e, gen, rev)
  local wanted = tonumber(redis.call('HGET', REVISIONS, pid) or '0')
  local cur = redis.call('HGET', KEYS[2], pid)
  if (tonumber(rev) or 0) < wanted then
    -- our own claim goes with it (as mark_part.lua): the new revision's run must not wait on it
    local mine = cur and cjson.decode(cur)
    if mine and mine['worker'] == ARGV[1] and tostring(mine['epoch']) == e then redis.call('HDEL', KEYS[2], pid) end
    return 'revision ' .. wanted
  end
  if cur then
    local claim = cjson.decode(cur)
    if claim['worker'] == ARGV[1] and tostring(claim['epoch']) == e then return nil end
    return tostring(claim['epoch'] or '') .. '@' .. tostring(claim['worker'])
  end
  if redis.call('SISMEMBER', KEYS[1], pid) == 1 then
    if redis.call('HGET', KEYS[9], pid) == row_e then return 'ours' end
    return 'done'
  end
  if redis.call('HEXISTS', KEYS[8], pid) == 1 then return 'dead' end
  if gen ~= '' and redis.call('HGET', KEYS[10], 'generation') ~= '"' .. gen .. '"' then return 'generation' end
  return nil
end
-- (not for a purged job: its record is gone, and a finalize must not bring its keys back)
if redis.call('EXISTS', KEYS[10]) == 1 then write_mark(MARKS, ARGV[1], ARGV[#ARGV]) end
local offers = #KEYS == 22 and KEYS[17] or nil
-- one entry of the commit log for a row just moved into done (see the top)
local function append(pid, rev, epoch, part, row)
  if redis.call('HEXISTS', FEED_LOG, 'id') == 0 then
    local t = redis.call('TIME')
    redis.call('HSET', FEED_LOG, 'id', string.format('%d%06d', t[1], t[2]))
    redis.call('HDEL', FEED_LOG, 'trimmed')
  end
  local entry = {'prompt_id', pid, 'revision', rev, 'epoch', epoch, 'part', part, 'row', row}
  local was = redis.call('HGET', KEYS[9], pid)
  if was and was ~= epoch then
    entry[#entry + 1] = 'replaces'
    entry[#entry + 1] = (redis.call('HGET', COMMITTED_REVISIONS, pid) or '0') .. ':' .. was
  end
  if (tonumber(rev) or 0) > 0 then redis.call('HSET', COMMITTED_REVISIONS, pid, rev) end
  redis.call('XADD', FEED, '*', unpack(entry))
end
-- past the cap and a tenth of it (at most 100 entries more), the oldest entries go down to the cap, and the log's
-- record keeps the highest id trimmed ('trimmed'): a reader whose position is below it lost entries (a stream's own
-- max-deleted-entry-id does not count trims)
local function cap_feed()
  if feed_max_len <= 0 then return end
  local over = redis.call('XLEN', FEED) - feed_max_len
  if over <= math.max(1, math.min(100, math.floor(feed_max_len / 10))) then return end
  local gone = redis.call('XRANGE', FEED, '-', '+', 'COUNT', over)
  redis.call('HSET', FEED_LOG, 'trimmed', gone[#gone][1])
  redis.call('XTRIM', FEED, 'MAXLEN', feed_max_len)
end
local offered_at = nil
if offers then
  local t = redis.call('TIME')
  offered_at = tonumber(t[1]) + tonumber(t[2]) / 1000000
end
for i = 5, #ARGV - 2, 18 do
  local pid = ARGV[i]
  local held = holder(pid, ARGV[i + 9], ARGV[i + 10], ARGV[i + 11], ARGV[i + 12])
  if held and held ~= 'ours' then
    fenced[#fenced + 1] = pid
    fenced[#fenced + 1] = held
  elseif not held then
    redis.call('HDEL', KEYS[2], pid)
    redis.call('HDEL', KEYS[7], pid)
    if redis.call('SADD', KEYS[1], pid) == 1 then
    append(pid, ARGV[i + 12], ARGV[i + 10], ARGV[i + 16], ARGV[i + 17])
    redis.call('HSET', KEYS[9], pid, ARGV[i + 10])
    new_rows = new_rows + 1
    tokens = tokens + tonumber(ARGV[i + 1])
    local f = ARGV[i + 2]
    if f == '1' then think = think + 1 end
    if f ~= '2' then
      expected = expected + 1
      flags[#flags + 1] = f
    end
    local cut, quality = string.match(ARGV[i + 3], '^(%d):?(.*)$')
    trunc = trunc + tonumber(cut)
    for name in string.gmatch(quality, '[^,]+') do flag_counts[name] = (flag_counts[name] or 0) + 1 end
    local reusable, cached = tonumber(ARGV[i + 14]), tonumber(ARGV[i + 15])
    if reusable and cached then
      redis.call('HINCRBY', KEYS[3], 'prefix_turns', 1)
      redis.call('HINCRBY', KEYS[3], 'prefix_reusable_tokens', reusable)
      redis.call('HINCRBY', KEYS[3], 'prefix_cached_tokens', math.min(cached, reusable))
    end
    if ARGV[i + 4] ~= '' then
      redis.call('HSET', KEYS[14], pid, ARGV[i + 4])
      chain_state(pid, ARGV[i + 4], ARGV[i + 5])
    end
    if ARGV[i + 5] ~= '' then
      take_out(ARGV[i + 5])
      redis.call('HSET', KEYS[12], ARGV[i + 5], ARGV[i + 6])
      -- a turn new to the job counts as submitted (status reads the counters, thinkfleet/state/counters.py)
      if redis.call('HEXISTS', KEYS[13], ARGV[i + 5]) == 0 then
        redis.call('HINCRBY', KEYS[3], 'submitted', 1)
        redis.call('HINCRBY', KEYS[4], 'submitted', 1)
      end
      redis.call('HSET', KEYS[13], ARGV[i + 5], ARGV[4])
      if offers then
        redis.call('LPUSH', KEYS[11], ARGV[i + 7])
        redis.call('ZADD', offers, offered_at, offer_member(ARGV[1], ARGV[i + 7]))
        offered = offered + 1
      else
        redis.call('RPUSH', KEYS[11], ARGV[i + 7])
      end
      local nrev = tonumber(ARGV[i + 13]) or 0
      if nrev > tonumber(redis.call('HGET', REVISIONS, ARGV[i + 5]) or '0') then
        redis.call('HSET', REVISIONS, ARGV[i + 5], nrev)
      end
      redis.call('HINCRBY', KEYS[3], 'turns_enqueued', 1)
    end
    if ARGV[i + 8] ~= '' then
      for _, id in ipairs(cjson.decode(ARGV[i + 8])) do
        take_out(id)
        -- its revision raised above any message of it (claim.lua raises it to each one it sees; a next turn's
        -- enqueue to its own): a leftover copy is superseded at its claim and its run fenced, never added to done
        local was = tonumber(redis.call('HGET', REVISIONS, id) or '0')
        redis.call('HSET', REVISIONS, id, was + 1)
        -- and out of the job: no chain derives it now, so it is not pending (status, wait and the live invariant
        -- count what is submitted); a later re-run that derives it again enqueues it as new
        if redis.call('HDEL', KEYS[13], id) == 1 then
          redis.call('HDEL', KEYS[12], id)
          redis.call('HINCRBY', KEYS[3], 'submitted', -1)
          redis.call('HINCRBY', KEYS[4], 'submitted', -1)
        end
      end
    end
  end
  end
end
-- (a purged job's straggler, 'generation', is not counted: its counters would bring the purged job's keys back)
local counted = 0
for n = 2, #fenced, 2 do
  if fenced[n] ~= 'generation' then counted = counted + 1 end
end
if counted > 0 then redis.call('HINCRBY', KEYS[3], 'fenced', counted) end
if new_rows == 0 then return {0, 0, 0, 0, fenced, 0} end
cap_feed()
if undead > 0 then
  redis.call('HINCRBY', KEYS[3], 'dead', -undead)
  redis.call('HINCRBY', KEYS[4], 'dead', -undead)
end
redis.call('HINCRBY', KEYS[3], 'done', new_rows - undone)
redis.call('HINCRBY', KEYS[3], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[3], 'think_end', think)
redis.call('HINCRBY', KEYS[3], 'missing_think_end', expected - think)
redis.call('HINCRBY', KEYS[3], 'expected_think_end', expected)
redis.call('HINCRBY', KEYS[3], 'truncated', trunc)
for name, n in pairs(flag_counts) do
  redis.call('HINCRBY', KEYS[3], 'flag:' .. name, n)
  redis.call('HINCRBY', KEYS[4], 'flag:' .. name, n)
end
redis.call('HINCRBY', KEYS[4], 'done', new_rows - undone)
redis.call('HINCRBY', KEYS[4], 'output_tokens', tokens)
redis.call('HINCRBY', KEYS[5], ARGV[1], tokens)
-- On Redis's clock, as leases are (workers/lease.py): a host whose clock is off would put its commits before
-- or after every rate window of `producer status`.
local now = redis.call('TIME')
local at = string.format('%d.%06d', now[1], now[2])
redis.call('ZADD', KEYS[6], at, at .. ':' .. new_rows .. ':' .. tokens)
-- The reasoning alarm watches the job's first alarm_min_rows rows expected to reason, then the running share.
local minrows = tonumber(ARGV[2])
local seen = tonumber(redis.call('HGET', KEYS[3], 'alarm_rows') or '0')
local miss = tonumber(redis.call('HGET', KEYS[3], 'alarm_missing') or '0')
for _, f in ipairs(flags) do
  if seen >= minrows then break end
  seen = seen + 1
  if f == '0' then miss = miss + 1 end
end
redis.call('HSET', KEYS[3], 'alarm_rows', seen, 'alarm_missing', miss)
local rows = tonumber(redis.call('HGET', KEYS[3], 'expected_think_end') or '0')
local missing_all = tonumber(redis.call('HGET', KEYS[3], 'missing_think_end'))
local share = tonumber(ARGV[3])
local fire = 0
if (seen >= minrows and miss >= share * minrows) or (rows >= minrows and missing_all >= share * rows) then
  fire = 1
end
return {new_rows, fire, seen, miss, fenced, offered}
