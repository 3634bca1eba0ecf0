-- Move up to ARGV[1] parked messages back onto the queue (behind what is queued, in their order), onto the
-- list of the job's priority ARGV[2] (0 = the queue itself, N = queue..sep..N); a message that says another
-- ``properties.priority`` (a copy a worker parked, re-encoded at 0) is rewritten to say ARGV[2]. With
-- ARGV[2] == '' (no job record) each message goes onto the list of the priority it says.
-- Only the list commands the old RPOPLPUSH script needed (the producer's ACL user has no RPOP/LREM/LTRIM):
-- a message to rewrite leaves the parked list through the scratch list KEYS[2], which is then deleted.
-- KEYS: parked, scratch, then the queue's priority lists for steps 0..9 ; returns how many are still parked.
local top = #KEYS - 3
local want = tonumber(ARGV[2])
if want and want > top then want = top end
-- The last ``"priority": N`` of a kombu message (its properties close the JSON; a JSON string holds no
-- unescaped quote, so only a key matches): start, end, N — or nil.
local function priority(m)
  local s, e, p
  local init = math.max(1, #m - 1024)
  for _ = 1, 2 do
    while true do
      local s1, e1, d = string.find(m, '"priority": (%d+)', init)
      if not s1 then break end
      s, e, p, init = s1, e1, tonumber(d), e1 + 1
    end
    if p then break end
    init = 1
  end
  return s, e, p
end
for _ = 1, tonumber(ARGV[1]) do
  local m = redis.call('LRANGE', KEYS[1], -1, -1)[1]
  if not m then break end
  local s, e, p = priority(m)
  local step = want or math.min(p or 0, top)
  if want and s and p ~= want then
    redis.call('LMOVE', KEYS[1], KEYS[2], 'RIGHT', 'LEFT')
    redis.call('DEL', KEYS[2])
    redis.call('LPUSH', KEYS[3 + step], string.sub(m, 1, s - 1) .. '"priority": ' .. want .. string.sub(m, e + 1))
  else
    redis.call('LMOVE', KEYS[1], KEYS[3 + step], 'RIGHT', 'LEFT')
  end
end
return redis.call('LLEN', KEYS[1])
