-- Shared functions, prepended to the scripts that use them (client/wire/records.py does the prepending). They
-- keep no state between calls and read no KEYS or ARGV: a script passes each function the keys it needs,
-- the metrics hash among them (`metrics`: GET /metrics reads it instead of every target; fields: backlog|KIND,
-- records dispatched and not settled, trainmedic_mailbox_backlog, and ACK's n|ACTION|STATUS, b|ACTION|BUCKET,
-- s|ACTION). It is the global hash on a single Redis and the target's own on a cluster.

-- The single Redis's metrics hash (client/wire/keys.py METRICS) and history journal (HIST_JOURNAL).
local GLOBAL_METRICS = 'trainmedic:metrics'
local GLOBAL_JOURNAL = 'trainmedic:hist:journal'
-- How long a cluster target's metrics hash and journal live after their last write (30 days, ms; the single
-- Redis's are bounded by their fields and their reader).
local KEEP_MS = 2592000000
-- Metrics keys whose TTL this call already set: once per key per call is enough (a call starts with none).
local metrics_ttl = {}

-- The history index (service/history.py) learns of a record that was made or whose status or outcome changed
-- through a journal of record ids: the global one on a single Redis (where `metrics` is the global hash),
-- else the target's own list in its slot (whoever ran the script names the target in trainmedic:hist:dirty,
-- client/wire/cluster.py mark_journaled, and the indexer moves the list to the global one). The service drains it.
local function journal_of(rec, metrics)
  local i = string.find(rec, ':rec:', 1, true)
  if not i then return nil, nil end
  if metrics == GLOBAL_METRICS then return GLOBAL_JOURNAL, string.sub(rec, i + 5) end
  return string.sub(rec, 1, i) .. 'hj', string.sub(rec, i + 5)
end

local function hist_touch(rec, metrics)
  local journal, rid = journal_of(rec, metrics)
  if not journal then return end
  redis.call('RPUSH', journal, rid)
  if journal ~= GLOBAL_JOURNAL then redis.call('PEXPIRE', journal, KEEP_MS) end
end

-- A record entered (1) or left (-1) the status `dispatched`: its kind's backlog moves with it.
local function count_backlog(rec, delta, metrics)
  local kind = string.match(rec, '{(%a+):')
  if kind then
    redis.call('HINCRBY', metrics, 'backlog|' .. kind, delta)
    if metrics ~= GLOBAL_METRICS and not metrics_ttl[metrics] then
      redis.call('PEXPIRE', metrics, KEEP_MS)
      metrics_ttl[metrics] = true
    end
  end
end

-- The writes that DECIDE_MANY's pairs share, made once at the end of the call (`later`, a table the call
-- starts empty): one RPUSH per journal, one HINCRBY per backlog, one PEXPIRE per key (a notification's
-- alerts mostly share their targets, journal and metrics hash).
local function later_touch(later, rec, metrics)
  local journal, rid = journal_of(rec, metrics)
  if not journal then return end
  later.journal[journal] = later.journal[journal] or {}
  table.insert(later.journal[journal], rid)
end

local function later_backlog(later, rec, delta, metrics)
  local kind = string.match(rec, '{(%a+):')
  if kind then
    later.backlog[metrics] = later.backlog[metrics] or {}
    later.backlog[metrics][kind] = (later.backlog[metrics][kind] or 0) + delta
  end
end

-- A key's TTL, written once per call (the longest asked for wins).
local function later_expire(later, key, ttl_ms)
  local have = later.expire[key]
  if not have or tonumber(ttl_ms) > tonumber(have) then later.expire[key] = ttl_ms end
end

local function later_flush(later)
  for journal, rids in pairs(later.journal) do
    redis.call('RPUSH', journal, unpack(rids))
    if journal ~= GLOBAL_JOURNAL then later_expire(later, journal, KEEP_MS) end
  end
  for metrics, kinds in pairs(later.backlog) do
    for kind, delta in pairs(kinds) do
      if delta ~= 0 then redis.call('HINCRBY', metrics, 'backlog|' .. kind, delta) end
    end
    -- The single Redis's hash has one field per count: it needs no TTL. A cluster's are per target.
    if metrics ~= GLOBAL_METRICS then later_expire(later, metrics, KEEP_MS) end
  end
  for key, ttl_ms in pairs(later.expire) do redis.call('PEXPIRE', key, ttl_ms) end
end

-- A record's status from its actions (README: HTTP API, a record): skipped actions do not count; applied
-- when all others were, partially_applied when some were; else expired when all expired, lost when some
-- were lost, failed otherwise; skipped when every action was skipped. Nothing changes while any action is
-- pending or delivered, nor for a record that is not dispatched. A settled record keeps when it settled
-- (now, in ms: the last ack) and drops its stored command. A record that answers for its alert (it has
-- `verify_ms`) gets its outcome: pending when something was applied, none when every action was skipped,
-- else unknown. A record the reconciler follows stays among the target's due items (open_z), due now, so it
-- looks at it at once.
local function done_or_follow(rec, open_z, rid, now)
  -- A record that ended leaves the due items, unless the reconciler follows it: then it is due now.
  if redis.call('HGET', rec, 'follow') == '1' then
    redis.call('ZADD', open_z, now, rid)
  else
    redis.call('ZREM', open_z, rid)
  end
end

local function settle(rec, now, open_z, rid, metrics)
  local cur = redis.call('HGET', rec, 'status')
  if cur ~= 'dispatched' then return cur end
  local n = tonumber(redis.call('HGET', rec, 'n') or '0')
  local counted, applied, expired, lost = 0, 0, 0, 0
  for i = 0, n - 1 do
    local st = redis.call('HGET', rec, 'a:' .. i .. ':status')
    if st == 'pending' or st == 'delivered' then return cur end
    if st ~= 'skipped' then
      counted = counted + 1
      if st == 'applied' then applied = applied + 1
      elseif st == 'expired' then expired = expired + 1
      elseif st == 'lost' then lost = lost + 1 end
    end
  end
  local status = 'failed'
  if counted == 0 then status = 'skipped'
  elseif applied == counted then status = 'applied'
  elseif applied > 0 then status = 'partially_applied'
  elseif expired == counted then status = 'expired'
  elseif lost > 0 then status = 'lost' end
  redis.call('HSET', rec, 'status', status, 'settled_ms', now)
  hist_touch(rec, metrics)
  count_backlog(rec, -1, metrics)
  redis.call('HDEL', rec, 'cmd', 'sig')
  -- A process did take it after all: "no live target" is no longer the record's story.
  if applied > 0 and redis.call('HGET', rec, 'reason') == 'no_live_target' then redis.call('HSET', rec, 'reason', '') end
  -- A record whose every action was skipped dispatched nothing: like any other skip, it has no outcome.
  if status ~= 'skipped' and redis.call('HEXISTS', rec, 'verify_ms') == 1 then
    local o = 'unknown'
    if applied > 0 then o = 'pending' end
    redis.call('HSET', rec, 'outcome', cjson.encode({status = o, resolved_at = cjson.null, time_to_resolve_s = cjson.null}))
  end
  done_or_follow(rec, open_z, rid, now)
  return status
end

-- End every open action of a record with one status and reason (a message for people in its result).
local function end_open(rec, status, reason, message, at)
  local n = tonumber(redis.call('HGET', rec, 'n') or '0')
  for i = 0, n - 1 do
    local p = 'a:' .. i .. ':'
    local st = redis.call('HGET', rec, p .. 'status')
    if st == 'pending' or st == 'delivered' then
      redis.call('HSET', rec, p .. 'status', status, p .. 'reason', reason, p .. 'acked_at', at,
                 p .. 'result', cjson.encode({message = message}))
    end
  end
end

-- Offer a record's stored, signed command again: its delivered actions become pending, a new mailbox entry
-- (after every cursor) names the record again, and a wake-up says "look now". false if nothing was stored.
local function reoffer(rec, mailbox, channel, maxlen, rid)
  local cmd = redis.call('HGET', rec, 'cmd')
  if not cmd then return false end
  local n = tonumber(redis.call('HGET', rec, 'n') or '0')
  for i = 0, n - 1 do
    local p = 'a:' .. i .. ':'
    if redis.call('HGET', rec, p .. 'status') == 'delivered' then
      redis.call('HSET', rec, p .. 'status', 'pending')
      redis.call('HDEL', rec, p .. 'claimed_by', p .. 'claimed_ms')
    end
  end
  redis.call('HINCRBY', rec, 'offers', 1)
  redis.call('XADD', mailbox, 'MAXLEN', '~', maxlen, '*', 'r', rid)
  redis.call('PUBLISH', channel, rid)
  return true
end

-- Actions decided before anything is sent (the live target cannot apply them): {index: {status, reason,
-- message}}, written with their time. The others stay `pending`.
local function decide_early(rec, early, at)
  for idx, e in pairs(early or {}) do
    local p = 'a:' .. idx .. ':'
    if redis.call('HGET', rec, p .. 'status') == 'pending' then
      redis.call('HSET', rec, p .. 'status', e[1], p .. 'reason', e[2], p .. 'acked_at', at,
                 p .. 'result', cjson.encode({message = e[3]}))
    end
  end
end

-- Store a record's signed command, name the record in the target's mailbox and wake the target (unless there
-- is none to send). A mailbox entry holds only the record's id (`r`): the command is stored once, in the
-- record, where the target reads it (client/receiver/mailbox.py).
local function send(rec, mailbox, channel, maxlen, rid, command, signature)
  if command == '' then return end
  redis.call('HSET', rec, 'cmd', command, 'sig', signature)
  redis.call('XADD', mailbox, 'MAXLEN', '~', maxlen, '*', 'r', rid)
  redis.call('PUBLISH', channel, rid)
end
