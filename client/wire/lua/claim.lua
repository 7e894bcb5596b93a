-- CLAIM: take one mailbox entry for this process before applying it, so it is applied at most once.
-- KEYS[1] cursor   KEYS[2] record   KEYS[3] due items (the reconciler's, for this target)
-- ARGV[1] entry id   ARGV[2] identity (host:pid[:rank])   ARGV[3] now (ms)   ARGV[4] cursor ttl (ms)
--   ARGV[5] now as RFC 3339   ARGV[6] record id   ARGV[7] when the reconciler should look at the claim (ms)
-- Returns 'ok' (ours to apply), 'taken' (another process claimed it), 'missing' (no such record: never
-- apply), 'expired' (its time passed: ended here, atomically with the claim), 'replayed' (an applier already
-- acknowledged it: this entry delivers it again) or 'gone' (nothing left open, e.g. the reconciler expired it).
local function older(x, y)
  local xm, xs = string.match(x, '^(%d+)-(%d+)$')
  local ym, ys = string.match(y, '^(%d+)-(%d+)$')
  xm, xs, ym, ys = tonumber(xm), tonumber(xs), tonumber(ym), tonumber(ys)
  return xm < ym or (xm == ym and xs <= ys)
end
local rec = KEYS[2]
-- KEYS[4] the metrics hash (see common.lua)
metrics_key = KEYS[4]
local cur = redis.call('GET', KEYS[1]) or '0-0'
if older(ARGV[1], cur) then return 'taken' end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[4])
if redis.call('EXISTS', rec) == 0 then return 'missing' end
local now = tonumber(ARGV[3])
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
  end_open(rec, 'expired', 'expired', 'The command expired before anyone applied it.', ARGV[5])
  settle(rec, now, KEYS[3], ARGV[6])
  return 'expired'
end
for i = 0, n - 1 do
  local p = 'a:' .. i .. ':'
  if redis.call('HGET', rec, p .. 'status') == 'pending' then
    redis.call('HSET', rec, p .. 'status', 'delivered', p .. 'claimed_by', ARGV[2], p .. 'claimed_ms', now)
  end
end
-- If this process dies before acking, the reconciler finds the claim here and offers it to the next one.
redis.call('ZADD', KEYS[3], 'LT', ARGV[7], ARGV[6])
return 'ok'
