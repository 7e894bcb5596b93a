-- Shared functions, prepended to the scripts that use them (client/wire/scripts.py does the prepending). They
-- keep no state between calls and read no KEYS or ARGV: a script passes each function the keys it needs.
--
-- A record (README: "How it works", the record) is one hash in its target's slot: `d`, what was decided (its
-- alert, playbook, steps and context, written once, sealed) and, beside it, what changes later: `status`,
-- `reason`, `as` (one character per action: its status, ACTION_CODES below), `r:I` (action I's answer, JSON:
-- reason, result, at, by), `exp` (when its command expires, ms), `sig` (the command's signature: the command is
-- rebuilt from `d` by whoever checks it), `f` (the reconciler follows it), `v` (verify, ms), `c` (who claimed
-- it, and when), `outcome`, and the service's marks.
--
-- `ctx` (every script that changes a status gets one): {journal = the history journal, metrics = the hash of
-- counts GET /metrics folds in, kind = the target's kind, up = the target's channel to the service or ''}.
-- The service's own scripts get the global journal and metrics hash on a single Redis; an applier's scripts,
-- and every script on Redis Cluster, get the target's own (its slot): the service folds those in.

-- Action status <-> code (client/wire/status.py ACTION_CODES says the same).
local CODE = {pending = 'P', delivered = 'D', applied = 'A', failed = 'F', unsupported = 'U', expired = 'E',
              skipped = 'S', lost = 'L'}
local NAME = {P = 'pending', D = 'delivered', A = 'applied', F = 'failed', U = 'unsupported', E = 'expired',
              S = 'skipped', L = 'lost'}

-- `as` with action i (from 0) set to code.
local function set_code(as, i, code)
  return string.sub(as, 1, i) .. code .. string.sub(as, i + 2)
end

-- A status or outcome change, for the history index (service/history.py folds the journal): c|rid|old|new for
-- a status, o|rid|old|new for an outcome ('-' for none).
local function journal(ctx, what, rid, old, new)
  redis.call('RPUSH', ctx.journal, what .. '|' .. rid .. '|' .. (old or '-') .. '|' .. new)
end

-- A record entered (1) or left (-1) the status `dispatched`: its kind's backlog moves with it.
local function count_backlog(ctx, delta)
  redis.call('HINCRBY', ctx.metrics, 'backlog|' .. ctx.kind, delta)
end

-- Tell the service to look at the target soon (an applier's script: it may not write the service's indexes).
local function tell(ctx, what)
  if ctx.up and ctx.up ~= '' then redis.call('PUBLISH', ctx.up, what) end
end

-- A record that ended leaves the due items, unless the reconciler follows it: then it is due now.
local function done_or_follow(rec, open_z, rid, now, follow)
  if follow == '1' then
    redis.call('ZADD', open_z, now, rid)
  else
    redis.call('ZREM', open_z, rid)
  end
end

-- A record's status from its actions (README: the record): skipped actions do not count; applied when all
-- others were, partially_applied when some were; else expired when all expired, lost when some were lost,
-- failed otherwise; skipped when every action was skipped. Nothing changes while any action is pending or
-- delivered, nor for a record that is not dispatched. A settled record keeps when it settled (now, ms) and
-- drops its signature (unless a sticky change in the job's ledger needs it to be checked again). A record
-- that answers for its alert (it has `v`) gets its outcome: pending when something was applied, none when
-- every action was skipped, else unknown.
local function settle(rec, now, open_z, rid, ctx)
  local h = redis.call('HMGET', rec, 'status', 'as', 'reason', 'v', 'ls', 'f')
  if h[1] ~= 'dispatched' then return h[1] end
  local as = h[2] or ''
  if string.find(as, '[PD]') then return h[1] end
  local counted, applied, expired, lost = 0, 0, 0, 0
  for code in string.gmatch(as, '.') do
    if code ~= 'S' then
      counted = counted + 1
      if code == 'A' then applied = applied + 1
      elseif code == 'E' then expired = expired + 1
      elseif code == 'L' then lost = lost + 1 end
    end
  end
  local status = 'failed'
  if counted == 0 then status = 'skipped'
  elseif applied == counted then status = 'applied'
  elseif applied > 0 then status = 'partially_applied'
  elseif expired == counted then status = 'expired'
  elseif lost > 0 then status = 'lost' end
  local w = {'status', status, 'settled_ms', now}
  -- A record whose every action was skipped dispatched nothing: like any other skip, it has no outcome.
  local outcome = nil
  if status ~= 'skipped' and h[4] then
    outcome = 'unknown'
    if applied > 0 then outcome = 'pending' end
    w[#w + 1] = 'outcome'
    w[#w + 1] = cjson.encode({status = outcome, resolved_at = cjson.null, time_to_resolve_s = cjson.null})
  end
  redis.call('HSET', rec, unpack(w))
  -- A process did take it after all: "no live target" is no longer the record's story.
  if applied > 0 and h[3] == 'no_live_target' then redis.call('HDEL', rec, 'reason') end
  if not h[5] then redis.call('HDEL', rec, 'sig') end
  journal(ctx, 'c', rid, 'dispatched', status)
  if outcome then journal(ctx, 'o', rid, '-', outcome) end
  count_backlog(ctx, -1)
  done_or_follow(rec, open_z, rid, now, h[6])
  return status
end

-- End every open action of a record with one status and reason (a message for people in its result).
local function end_open(rec, code, reason, message, at)
  local as = redis.call('HGET', rec, 'as') or ''
  local w = {}
  for i = 0, #as - 1 do
    local c = string.sub(as, i + 1, i + 1)
    if c == 'P' or c == 'D' then
      as = set_code(as, i, code)
      w[#w + 1] = 'r:' .. i
      w[#w + 1] = cjson.encode({reason = reason, result = {message = message}, at = at})
    end
  end
  if #w > 0 then
    w[#w + 1] = 'as'
    w[#w + 1] = as
    redis.call('HSET', rec, unpack(w))
  end
end

-- A record's command goes into its target's mailbox: an entry that names the record by its id's head (the
-- target's records share the rest), counted among the mailbox's waiting commands (the state's `q`).
local function deliver(mailbox, state, rid)
  redis.call('XADD', mailbox, '*', 'r', string.sub(rid, 1, 26))
  redis.call('HINCRBY', state, 'q', 1)
end

-- Offer a record's command again: its delivered actions become pending and a new mailbox entry names the
-- record again. false if it has no command (its signature is gone: it ended, or never had one).
local function reoffer(rec, mailbox, state, rid)
  local h = redis.call('HMGET', rec, 'sig', 'as')
  if not h[1] then return false end
  local as = string.gsub(h[2] or '', 'D', 'P')
  redis.call('HSET', rec, 'as', as)
  redis.call('HDEL', rec, 'c')
  redis.call('HINCRBY', rec, 'offers', 1)
  deliver(mailbox, state, rid)
  return true
end

-- Actions decided before anything is sent (the live target cannot apply them, or their condition did not
-- hold): {index: [status, reason, message]}, written with their time into `as` and their answers. The others
-- keep their code.
local function decide_early(as, early, at, w)
  for idx, e in pairs(early or {}) do
    local i = tonumber(idx)
    local code = CODE[e[1]]
    if code and i and i >= 0 and i < #as and string.sub(as, i + 1, i + 1) == 'P' then
      as = set_code(as, i, code)
      w[#w + 1] = 'r:' .. i
      w[#w + 1] = cjson.encode({reason = e[2], result = {message = e[3]}, at = at})
    end
  end
  return as
end

-- A firing remediation dispatched to a node (Lemon nodes): counted by playbook (the counter
-- trainmedic_node_incidents_total; the counts go keep_ms after the node's last incident, as a counter that
-- restarts), and kept with its time among the node's incidents of the last window_ms.
-- It runs after the record is written, so it must not fail: a key of another type, or a count that is not
-- one, is put right first (GET /metrics leaves such a count out, and counts it as a repair, until then).
local function count_incident(counts, times, pb, rid, now, window_ms, keep_ms)
  if redis.call('TYPE', counts).ok ~= 'hash' then redis.call('DEL', counts) end
  if redis.call('TYPE', times).ok ~= 'zset' then redis.call('DEL', times) end
  local n = redis.call('HGET', counts, pb)
  if n and not string.match(n, '^%d+$') then redis.call('HDEL', counts, pb) end
  redis.call('HINCRBY', counts, pb, 1)
  redis.call('PEXPIRE', counts, keep_ms)
  redis.call('ZADD', times, now, rid)
  redis.call('ZREMRANGEBYSCORE', times, '-inf', now - window_ms)
  redis.call('PEXPIRE', times, window_ms)
end
