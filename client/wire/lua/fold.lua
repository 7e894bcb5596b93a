-- FOLD: one batch of the history indexer on a single Redis (service/history.py; on Redis Cluster, where the
-- records live in other slots, _drain_batch does the same in Python). It takes a batch of record ids from the
-- journal and writes their index entries: a sequence number and the status, outcome, playbook and
-- alertname bitmaps for a new record, the status and outcome bitmaps again for a changed one, the history and
-- per-target sorted sets, the segment's list of bitmaps. Atomic, and only while the indexer's lock still holds
-- its token: an indexer whose lock lapsed writes nothing.
-- Returns how many journal entries it took, or -1 when the lock was not `token` (nothing written).
local journal = KEYS[1]              -- the history journal (record ids)
local lock = KEYS[2]                 -- the indexer's lock
local counter = KEYS[3]              -- the sequence counter
local history_key = KEYS[4]          -- the history (sorted set)
local token = ARGV[1]                -- the lock token
local batch = tonumber(ARGV[2])      -- journal entries taken at most
local seg_size = tonumber(ARGV[3])   -- records per segment
local hp = ARGV[4]                   -- the history's key prefix
local prefix = ARGV[5]               -- trainmedic's key prefix

if redis.call('GET', lock) ~= token then return -1 end
local rids = redis.call('LRANGE', journal, 0, batch - 1)
if #rids == 0 then return 0 end

-- service/history.py _hashed: the first 16 hex digits of the value's SHA-1.
local function hashed(value) return string.sub(redis.sha1hex(value), 1, 16) end

-- service/history.py _mutable: "status|outcome" (outcome 'none' when there is none).
local function mutable(status, outcome)
  local o = nil
  if outcome and outcome ~= '' then
    local ok, d = pcall(cjson.decode, outcome)
    if ok and type(d) == 'table' and type(d.status) == 'string' and d.status ~= '' then o = d.status end
  end
  return status .. '|' .. (o or 'none')
end

-- service/history.py _bits: the bitmaps a record's bit is set in (playbook and alertname only when given).
local function bits(seq, state, playbook, alertname)
  local seg = math.floor(seq / seg_size)
  local bar = string.find(state, '|', 1, true)
  local p = hp .. 'bm:' .. seg .. ':'
  local out = {p .. 's:' .. string.sub(state, 1, bar - 1), p .. 'o:' .. string.sub(state, bar + 1)}
  if playbook then
    out[3] = p .. 'p:' .. hashed(playbook)
    out[4] = p .. 'a:' .. hashed(alertname)
  end
  return out, seg
end

local rows, seen, fresh = {}, {}, 0
for _, rid in ipairs(rids) do
  if not seen[rid] then
    seen[rid] = true
    local head, kind, name = string.match(rid, '^([0-9A-Z]+)~(%l+)~([%w_%.:@%-]*)$')
    if head and #head == 26 and (kind == 'job' or kind == 'node') and #name <= 128 then
      local tag = prefix .. '{' .. kind .. ':' .. name .. '}:'
      local rkey = tag .. 'rec:' .. rid
      local h = redis.call('HMGET', rkey, 'seq', 'hx', 'status', 'outcome')
      -- A record gone meanwhile is skipped: retention clears what it left.
      if h[3] then
        rows[#rows + 1] = {rid, rkey, tag .. 'hist', h}
        if not h[1] then fresh = fresh + 1 end
      end
    end
  end
end

local next_seq = 0
if fresh > 0 then next_seq = redis.call('INCRBY', counter, fresh) - fresh + 1 end
local history, targets, ttls, segments = {}, {}, {}, {}
local function set_bits(names, seg, seq, value)
  for _, k in ipairs(names) do
    redis.call('SETBIT', k, seq % seg_size, value)
    if value == 1 then
      segments[seg] = segments[seg] or {}
      segments[seg][k] = true
    end
  end
end

for _, row in ipairs(rows) do
  local rid, rkey, tkey, h = row[1], row[2], row[3], row[4]
  local state = mutable(h[3], h[4])
  local seq
  if not h[1] then
    seq = next_seq
    next_seq = next_seq + 1
    local more = redis.call('HMGET', rkey, 'playbook', 'alert')
    local alertname = ''
    if more[2] then
      local ok, d = pcall(cjson.decode, more[2])
      if ok and type(d) == 'table' and (type(d.alertname) == 'string' or type(d.alertname) == 'number') then
        alertname = tostring(d.alertname)
      end
    end
    set_bits(bits(seq, state, more[1] or '', alertname), math.floor(seq / seg_size), seq, 1)
    redis.call('HSET', rkey, 'seq', seq, 'hx', state)
  else
    seq = tonumber(h[1])
    if h[2] ~= state then
      if h[2] then set_bits(bits(seq, h[2]), 0, seq, 0) end
      set_bits(bits(seq, state), math.floor(seq / seg_size), seq, 1)
      redis.call('HSET', rkey, 'hx', state)
    end
  end
  -- Listed (again: idempotent, it heals a listing lost to a crash). A record that left the history has left
  -- Redis too (retention deletes it, or it expired), so it is never listed again.
  history[#history + 1] = seq
  history[#history + 1] = rid
  if not targets[tkey] then targets[tkey], ttls[tkey] = {}, 0 end
  local t = targets[tkey]
  t[#t + 1] = seq
  t[#t + 1] = rid
  local ttl = redis.call('PTTL', rkey)
  if ttl > ttls[tkey] then ttls[tkey] = ttl end
end

if #history > 0 then redis.call('ZADD', history_key, unpack(history)) end
for tkey, members in pairs(targets) do
  redis.call('ZADD', tkey, unpack(members))
  -- As long as its newest record lives (the retention sweep removes the entries of older ones): never
  -- shortened. (PTTL, not PEXPIRE's NX and GT: those are Redis 7, and the embedded Redis may be 6.2.)
  if ttls[tkey] > 0 and redis.call('PTTL', tkey) < ttls[tkey] then redis.call('PEXPIRE', tkey, ttls[tkey]) end
end
for seg, names in pairs(segments) do
  local list = {}
  for k in pairs(names) do list[#list + 1] = k end
  redis.call('SADD', hp .. 'seg:' .. seg, unpack(list))
end
redis.call('LTRIM', journal, #rids, -1)
return #rids
