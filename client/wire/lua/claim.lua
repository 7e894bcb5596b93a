-- CLAIM: take one mailbox entry for this process before applying it, so it is applied at most once.
-- Returns 'ok' (ours to apply; also when this process claimed it already and lost the answer), 'taken'
-- (another process claimed it), 'missing' (no such record: never apply), 'expired' (its time passed: ended
-- here, atomically with the claim), 'replayed' (an applier already acknowledged it: this entry delivers it
-- again) or 'gone' (nothing left open, e.g. the reconciler expired it).
-- The entry, and every older one, leaves the mailbox: what it holds is only what waits.
local cursor = KEYS[1]           -- the process's mailbox cursor
local rec = KEYS[2]              -- the record
local open_z = KEYS[3]           -- the target's due items (the reconciler's)
local mailbox = KEYS[4]          -- the target's mailbox
local state = KEYS[5]            -- the target's state (its field q counts the mailbox's waiting entries)
local journal_key = KEYS[6]      -- the target's history journal
local metrics = KEYS[7]          -- the target's metrics hash
local entry_id = ARGV[1]         -- the mailbox entry's id
local identity = ARGV[2]         -- host:pid[:rank]
local now = tonumber(ARGV[3])    -- ms
local cursor_ttl = ARGV[4]       -- ms
local at = ARGV[5]               -- now as RFC 3339
local rid = ARGV[6]              -- the record's id
local look_at = ARGV[7]          -- when the reconciler should look at the claim (ms)
local kind = ARGV[8]             -- the target's kind
local up = ARGV[9]               -- the target's channel to the service
local ctx = {journal = journal_key, metrics = metrics, kind = kind, up = up}

local function parse(x)
  local ms, seq = string.match(x, '^(%d+)-(%d+)$')
  return tonumber(ms), tonumber(seq)
end
local em, es = parse(entry_id)
if not em then return 'missing' end
local cm, cs = parse(redis.call('GET', cursor) or '0-0')
if not cm then cm, cs = 0, 0 end
if em < cm or (em == cm and es <= cs) then
  -- This process asking again for a claim whose answer it lost: still its own while nothing was answered.
  local mine = redis.call('HMGET', rec, 'c', 'as')
  if mine[1] and string.sub(mine[1], 1, #identity + 1) == identity .. '|' and string.find(mine[2] or '', 'D') then
    return 'ok'
  end
  return 'taken'
end
redis.call('SET', cursor, entry_id, 'PX', cursor_ttl)
-- Everything up to this entry is taken: the mailbox keeps only what waits (never trimmed otherwise).
local gone = redis.call('XTRIM', mailbox, 'MINID', em .. '-' .. (es + 1))
if gone > 0 then
  local q = redis.call('HINCRBY', state, 'q', -gone)
  if q < 0 then redis.call('HSET', state, 'q', 0) end
end
local h = redis.call('HMGET', rec, 'status', 'as', 'exp', 'acked')
if not h[1] then return 'missing' end
local as = h[2] or ''
if not string.find(as, 'P') then
  if h[4] then return 'replayed' end
  return 'gone'
end
local expires = tonumber(h[3] or '0')
if expires > 0 and now > expires then
  end_open(rec, 'E', 'expired', 'The command expired before anyone applied it.', at)
  if settle(rec, now, open_z, rid, ctx) ~= 'dispatched' then tell(ctx, 'acks') end
  return 'expired'
end
redis.call('HSET', rec, 'as', (string.gsub(as, 'P', 'D')), 'c', identity .. '|' .. now)
-- If this process dies before acking, the reconciler finds the claim here and offers it to the next one.
redis.call('ZADD', open_z, 'LT', look_at, rid)
return 'ok'
