-- CLAIM: take one mailbox entry for this process before applying it, so it is applied at most once.
-- Returns 'ok' (ours to apply), 'taken' (another process claimed it), 'missing' (no such record: never
-- apply), 'expired' (its time passed: ended here, atomically with the claim), 'replayed' (an applier already
-- acknowledged it: this entry delivers it again) or 'gone' (nothing left open, e.g. the reconciler expired it).
local cursor = KEYS[1]           -- the process's mailbox cursor
local rec = KEYS[2]              -- the record
local open_z = KEYS[3]           -- the target's due items (the reconciler's)
local metrics = KEYS[4]          -- the metrics hash (common.lua)
local entry_id = ARGV[1]         -- the mailbox entry's id
local identity = ARGV[2]         -- host:pid[:rank]
local now = tonumber(ARGV[3])    -- ms
local cursor_ttl = ARGV[4]       -- ms
local at = ARGV[5]               -- now as RFC 3339
local rid = ARGV[6]              -- the record's id
local look_at = ARGV[7]          -- when the reconciler should look at the claim (ms)

local function older(x, y)
  local xm, xs = string.match(x, '^(%d+)-(%d+)$')
  local ym, ys = string.match(y, '^(%d+)-(%d+)$')
  xm, xs, ym, ys = tonumber(xm), tonumber(xs), tonumber(ym), tonumber(ys)
  return xm < ym or (xm == ym and xs <= ys)
end
local cur = redis.call('GET', cursor) or '0-0'
if older(entry_id, cur) then return 'taken' end
redis.call('SET', cursor, entry_id, 'PX', cursor_ttl)
if redis.call('EXISTS', rec) == 0 then return 'missing' end
local n = tonumber(redis.call('HGET', rec, 'n') or '0')
local expires = tonumber(redis.call('HGET', rec, 'expires_ms') or '0')
local open = 0
for i = 0, n - 1 do
  if redis.call('HGET', rec, 'a:' .. i .. ':status') == 'pending' then open = open + 1 end
end
if open == 0 then
  for i = 0, n - 1 do
    if redis.call('HEXISTS', rec, 'a:' .. i .. ':acked_by') == 1 then return 'replayed' end
  end
  return 'gone'
end
if expires > 0 and now > expires then
  end_open(rec, 'expired', 'expired', 'The command expired before anyone applied it.', at)
  settle(rec, now, open_z, rid, metrics)
  return 'expired'
end
for i = 0, n - 1 do
  local p = 'a:' .. i .. ':'
  if redis.call('HGET', rec, p .. 'status') == 'pending' then
    redis.call('HSET', rec, p .. 'status', 'delivered', p .. 'claimed_by', identity, p .. 'claimed_ms', now)
  end
end
-- If this process dies before acking, the reconciler finds the claim here and offers it to the next one.
redis.call('ZADD', open_z, 'LT', look_at, rid)
return 'ok'
