-- FOLD: one batch of the history indexer on a single Redis (service/history.py; on Redis Cluster, where the
-- records live in other slots, its fold_entries does the same in Python). It takes a batch of entries from the
-- journal and writes the index: for a new record (n|rid|playbook|alertname) a sequence number, its place in
-- the history and its target's list, and its bits in the segment's bitmaps (its status and outcome as the
-- record holds them now, and its facet: playbook and alert name); for a change (c|rid|old|new of a status,
-- o|rid|old|new of an outcome) the old bit cleared and the new one set; for an entry that only names a record
-- (h|rid, or a bare id an earlier version wrote) the record indexed if it is not yet. Atomic, and only while
-- the indexer's lock still holds its token: an indexer whose lock lapsed writes nothing.
-- Returns how many journal entries it took, or -1 when the lock was not `token` (nothing written).
local journal = KEYS[1]              -- the history journal
local lock = KEYS[2]                 -- the indexer's lock
local counter = KEYS[3]              -- the sequence counter
local history_key = KEYS[4]          -- the history (sorted set)
local facets_key = KEYS[5]           -- the facets (hash: facet digest -> playbook \n alert name)
local token = ARGV[1]                -- the lock token
local batch = tonumber(ARGV[2])      -- journal entries taken at most
local seg_size = tonumber(ARGV[3])   -- records per segment
local hp = ARGV[4]                   -- the history's key prefix
local prefix = ARGV[5]               -- trainmedic's key prefix

if redis.call('GET', lock) ~= token then return -1 end
local entries = redis.call('LRANGE', journal, 0, batch - 1)
if #entries == 0 then return 0 end

-- service/history.py digest: the first 16 hex digits of the value's SHA-1.
local function digest(value) return string.sub(redis.sha1hex(value), 1, 16) end

-- A record id's key, and its target's list of records; nil for what is not an id.
local function keys_of(rid)
  local head, kind, name = string.match(rid, '^([0-9A-Z]+)~(%l+)~([%w_%.:@%-]*)$')
  if not head or #head ~= 26 or (kind ~= 'job' and kind ~= 'node') or #name > 128 then return nil end
  local tag = prefix .. '{' .. kind .. ':' .. name .. '}:'
  return tag .. 'rec:' .. rid, tag .. 'hist'
end

-- The outcome's status of a record's `outcome` field (nil for none).
local function outcome_of(text)
  if not text or text == '' then return nil end
  local ok, d = pcall(cjson.decode, text)
  if ok and type(d) == 'table' and type(d.status) == 'string' and d.status ~= '' then return d.status end
  return nil
end

local seqs = {}         -- rid -> sequence number: known (ZSCORE) or given in this batch
local function seq_of(rid)
  if seqs[rid] == nil then seqs[rid] = tonumber(redis.call('ZSCORE', history_key, rid)) or false end
  return seqs[rid]
end
local history, targets, segments, facets = {}, {}, {}, {}
local function bit(seq, field, value, on)
  local seg = math.floor(seq / seg_size)
  local k = hp .. 'bm:' .. seg .. ':' .. field .. ':' .. value
  redis.call('SETBIT', k, seq % seg_size, on)
  if on == 1 then
    segments[seg] = segments[seg] or {}
    segments[seg][k] = true
  end
end
-- Sequence numbers for the batch's new records, taken at once: as many as it has entries that may make one (a
-- record gone meanwhile leaves its number unused).
local next_seq = nil
local function take_seq()
  if not next_seq then
    local n = 0
    for _, entry in ipairs(entries) do
      local what, rest = string.match(entry, '^(%a)|(.*)$')
      if not what then what, rest = 'h', entry end
      -- A new record's entry is its first (DECIDE makes each record once); one that only names a record
      -- needs a number when the record is not listed yet.
      if what == 'n' or (what == 'h' and keys_of(rest) and not seq_of(rest)) then n = n + 1 end
    end
    next_seq = redis.call('INCRBY', counter, n) - n + 1
  end
  local seq = next_seq
  next_seq = next_seq + 1
  return seq
end
local function index(rid, rkey, tkey, playbook, alertname)
  local h = redis.call('HMGET', rkey, 'status', 'outcome')
  if not h[1] then return end  -- gone meanwhile: retention clears what it left
  local seq = take_seq()
  seqs[rid] = seq
  bit(seq, 's', h[1], 1)
  local o = outcome_of(h[2])
  if o then bit(seq, 'o', o, 1) end
  local f = digest(playbook .. '\n' .. alertname)
  facets[f] = playbook .. '\n' .. alertname
  bit(seq, 'f', f, 1)
  history[#history + 1] = seq
  history[#history + 1] = rid
  targets[tkey] = targets[tkey] or {}
  local t = targets[tkey]
  t[#t + 1] = seq
  t[#t + 1] = rid
end

-- What an entry that names a record only must read: its playbook and alert name, from what was decided.
local function facts(rkey)
  local h = redis.call('HMGET', rkey, 'd', 'playbook', 'alert')
  local pb, alert = h[2], h[3]
  if h[1] then
    local ok, d = pcall(cjson.decode, h[1])
    if ok and type(d) == 'table' then pb, alert = d.p, d.a end
  elseif alert then
    local ok, d = pcall(cjson.decode, alert)
    alert = ok and d or nil
  end
  local name = type(alert) == 'table' and alert.alertname
  if type(name) ~= 'string' and type(name) ~= 'number' then name = '' end
  return type(pb) == 'string' and pb or '', tostring(name)
end

for _, entry in ipairs(entries) do
  local what, rest = string.match(entry, '^(%a)|(.*)$')
  if not what then what, rest = 'h', entry end
  if what == 'n' then
    local rid, playbook, alertname = string.match(rest, '^([^|]+)|([^|]*)|(.*)$')
    local rkey, tkey = nil, nil
    if rid then rkey, tkey = keys_of(rid) end
    if rkey then index(rid, rkey, tkey, playbook, alertname) end
  elseif what == 'h' then
    local rkey, tkey = keys_of(rest)
    if rkey and not seq_of(rest) then
      local playbook, alertname = facts(rkey)
      index(rest, rkey, tkey, playbook, alertname)
    end
  elseif what == 'c' or what == 'o' then
    local rid, old, new = string.match(rest, '^([^|]+)|([%w_%-]+)|([%w_]+)$')
    local seq = rid and keys_of(rid) and seq_of(rid)
    -- A change of a record not indexed yet: its entry n, folded later, reads the record as it is then.
    if seq then
      local field = what == 'c' and 's' or 'o'
      if old ~= new and old ~= '-' then bit(seq, field, old, 0) end
      bit(seq, field, new, 1)
    end
  end
end

if #history > 0 then redis.call('ZADD', history_key, unpack(history)) end
for tkey, members in pairs(targets) do redis.call('ZADD', tkey, unpack(members)) end
for seg, names in pairs(segments) do
  local list = {}
  for k in pairs(names) do list[#list + 1] = k end
  redis.call('SADD', hp .. 'seg:' .. seg, unpack(list))
end
local fl = {}
for f, text in pairs(facets) do
  fl[#fl + 1] = f
  fl[#fl + 1] = text
end
if #fl > 0 then redis.call('HSET', facets_key, unpack(fl)) end
redis.call('LTRIM', journal, #entries, -1)
return #entries
