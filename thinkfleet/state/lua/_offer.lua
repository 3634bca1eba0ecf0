-- The member of the affinity offers ZSET (Keys.affinity_offers) for message m offered to worker w's host list:
-- 'w\n{task id}', the task id cut out of kombu's envelope as park.lua does (the headers follow the large body: near
-- the end first), or the message's SHA1 when it names none. finalize.lua writes it with the offer; the host's pop and
-- the sweep's steal (thinkfleet/broker/affinity.py) compute it again from the message to remove it.
local function offer_member(w, m)
  local _, e = string.find(m, '"id": "', math.max(1, #m - 4096), true)
  if not e then _, e = string.find(m, '"id"%s*:%s*"') end
  local id = e and string.match(m, '^([^"\\]*)"', e + 1)
  return w .. '\n' .. (id or redis.sha1hex(m))
end
