-- DECIDE: guard, record and dispatch one (alert, playbook) pair atomically, in the target's hash slot (DECIDE_MANY
-- runs this once per pair, as its function decide_one; it never runs on its own).
-- Its ARGV[1], decoded by DECIDE_MANY: {
--   now (ms), mode: firing | resolved | timeout | manual | stage, start (episode start, second precision), rid,
--   ends_ms, ends_at (a resolve's endsAt), follow (0/1: the reconciler follows the record),
--   early ({index: [status, reason, message]}: actions the live target cannot apply), no_live (1: no live
--   target heartbeats), defer (1: `when:` conditions first; the reconciler sends the command),
--   forced_reason ('' or why it is skipped), cooldown_ms, budget_count, budget_window_ms, approval (0/1),
--   dry (0/1), undo (1: the playbook has on_resolved actions), record_ttl_ms, episode_ttl_ms, maxlen,
--   channel, command, signature, expires_ms, approve_by_ms, ob_member, ob_due_ms, n, fields {name: value},
--   at (now as RFC 3339), hb (1: read the heartbeat), need (the actions the command was signed with)}
-- Returns {status, record id, reason}. 'duplicate', 'stale' and 'closed' mean no new record.
--
-- Episodes (one remediation per firing episode): the episode hash holds `open` (start of the open episode), `closed`
-- (latest start of a closed one, kept as a tombstone), `rid` (the open episode's record, its head: ep_rid)
-- and `holds` (records held for approval); a resolve leaves `res_start`, `res_ms` and `res_at` (the closed
-- episode's start and its endsAt), from which the reconciler decides outcomes. The obligation hash (rid, dry,
-- seen) says that a firing record changed something that the final resolve must undo, whichever episode
-- it belonged to. An escalation stage (mode stage) is a record of the open episode made by the reconciler:
-- once per previous record (its `next`), never after the episode closed, never held back by cooldown.
-- The heartbeat: with hb = 1, DECIDE reads it instead of the service (one round trip less). No heartbeat:
-- no_live. A heartbeat that lists every action of `need` (the command was signed with all of them): as sent.
-- Anything else (an action it lacks, no list, not JSON): {'reach', '', ''} before any write, and the service
-- decides that pair again with the heartbeat read and the command made to fit.
local rec = KEYS[1]            -- the record
local mailbox = KEYS[2]        -- the target's mailbox
local ep = KEYS[3]             -- the episode
local cooldown_key = KEYS[4]   -- the playbook's cooldown on the target
local budget_key = KEYS[5]     -- the playbook's budget on the target (sorted set of record ids by time)
local ob = KEYS[6]             -- the obligation (what on_resolved must undo for this alert)
local open_z = KEYS[7]         -- the target's due items
local prev_rec = KEYS[8]       -- the ladder's previous record (mode stage; else the record again)
local metrics = KEYS[9]        -- the metrics hash (common.lua)
local heartbeat = KEYS[10]     -- the target's heartbeat (read with hb = 1)
-- The pair's arguments (above): DECIDE_MANY passes the table it decoded already (decoding ~2.6 KB of JSON is
-- a good part of a call).
local a = ARGV[1]
local now, mode, rid, n = tonumber(a.now), a.mode, a.rid, tonumber(a.n)
local dry = tonumber(a.dry) == 1
local reason = ''

if tonumber(a.hb) == 1 then
  local raw = redis.call('GET', heartbeat)
  if not raw then
    a.no_live = 1
  else
    local ok, hb = pcall(cjson.decode, raw)
    local listed = ok and type(hb) == 'table' and hb.actions
    if type(listed) ~= 'table' then return {'reach', '', ''} end
    local have = {}
    for _, x in ipairs(listed) do have[x] = true end
    for _, x in ipairs(a.need) do
      if not have[x] then return {'reach', '', ''} end
    end
  end
end

local prefix = string.sub(rec, 1, #rec - #rid)
-- The episode keeps its record's time-sortable head only (26 characters): the rest names the target, whose
-- key the episode is. One written before keeps the whole id.
local function ep_rid()
  local r = redis.call('HGET', ep, 'rid')
  if r and #r == 26 then return r .. string.sub(rid, 27) end
  return r
end

-- The later of an episode's open start and the latest start it has seen (hi: before a merge moved it earlier).
local function latest_start(open, hi)
  if open and hi and hi > open then return hi end
  return open
end

local function close_episode()
  local oc = redis.call('HMGET', ep, 'open', 'closed', 'hi')
  local open, closed = oc[1], oc[2]
  local last = latest_start(open, oc[3])
  if last and (not closed or last > closed) then redis.call('HSET', ep, 'closed', last) end
  if mode == 'resolved' and open then
    redis.call('HSET', ep, 'res_start', open, 'res_ms', a.ends_ms, 'res_at', a.ends_at)
    -- The episode's ladder (its first record, then each `next`) learns of the resolve at once.
    local r, hops = ep_rid(), 0
    while r and r ~= '' and hops < 64 do
      if redis.call('HGET', prefix .. r, 'follow') == '1' then redis.call('ZADD', open_z, now, r) end
      r, hops = redis.call('HGET', prefix .. r, 'next'), hops + 1
    end
  end
  redis.call('HDEL', ep, 'open', 'rid', 'hi', 'st')  -- st: written by earlier versions
  -- The alert is over: a hold that nobody approved must not throttle a GPU that nothing will restore.
  local holds = redis.call('HGET', ep, 'holds')
  if holds then
    for held in string.gmatch(holds, '%S+') do
      local hrec = prefix .. held
      if redis.call('HGET', hrec, 'status') == 'pending_approval' then
        end_open(hrec, 'expired', 'resolved_before_approval', 'The alert resolved before anyone approved it.', a.at)
        redis.call('HSET', hrec, 'status', 'expired', 'reason', 'resolved_before_approval')
        hist_touch(hrec, metrics)
        done_or_follow(hrec, open_z, held, now)
      end
    end
    redis.call('HDEL', ep, 'holds')
  end
  redis.call('PEXPIRE', ep, a.episode_ttl_ms)
end

-- Take the undo obligation for a resolve; false when nothing was changed that needs undoing.
local function discharge()
  if redis.call('EXISTS', ob) == 0 then return false end
  if redis.call('HGET', ob, 'dry') == '1' then dry = true end
  redis.call('DEL', ob)
  redis.call('ZREM', open_z, a.ob_member)
  return true
end

-- Whether the obligation exists, read once (nothing between the two reads of a firing decide changes it).
local ob_exists = nil
if mode == 'firing' then
  -- Every firing notification, a resend too, says the alert still fires: resolve_timeout counts from here.
  ob_exists = redis.call('EXISTS', ob) == 1
  if ob_exists then
    redis.call('HSET', ob, 'seen', now)
    redis.call('ZADD', open_z, a.ob_due_ms, a.ob_member)
  end
  local oc = redis.call('HMGET', ep, 'open', 'closed', 'hi')
  local open, closed = oc[1], oc[2]
  local top = latest_start(open, oc[3])
  if open and a.start <= top then
    -- The open episode: a resend, a retry, an HA peer; an earlier start is the same alert merged from
    -- two Prometheus servers (never one of a closed episode's, which is a late retry of that episode).
    -- The episode keeps its latest start too (hi), so a late retry with the start from before the merge is
    -- still this episode, while it is open and after it closed.
    if a.start < open and (not closed or a.start > closed) then redis.call('HSET', ep, 'open', a.start, 'hi', top) end
    redis.call('PEXPIRE', ep, a.episode_ttl_ms)
    return {'duplicate', ep_rid() or '', ''}
  end
  if closed and a.start <= closed then
    redis.call('PEXPIRE', ep, a.episode_ttl_ms)
    return {'duplicate', '', 'closed_episode'}
  end
  if open then
    -- A later start while one is open: the alert resolved and fired again within one group_interval, so
    -- Alertmanager never sent that resolve. The old episode is over; its obligation stays with the alert.
    redis.call('HSET', ep, 'closed', top)
    redis.call('HDEL', ep, 'hi')
  end
elseif mode == 'resolved' or mode == 'timeout' then
  local open = redis.call('HGET', ep, 'open')
  if mode == 'resolved' and (not open or open > a.start) then
    -- No open episode, or a stale resolve of an older one: it must not close (or undo) a newer episode.
    return {'stale', '', ''}
  end
  close_episode()
  if not discharge() or n == 0 then return {'closed', '', ''} end
  if mode == 'timeout' then reason = 'resolved_not_notified' end
elseif mode == 'stage' then
  local prev = redis.call('HGET', prev_rec, 'next')
  if prev and prev ~= '' then return {'duplicate', prev, ''} end
  local open = redis.call('HGET', ep, 'open')
  -- The episode resolved, or a later one replaced it: the ladder is over.
  if not open or open > a.start then return {'closed', '', ''} end
end

local status = 'dispatched'
if a.forced_reason ~= '' then
  status, reason = 'skipped', a.forced_reason
elseif n == 0 then
  status, reason = 'skipped', 'no_actions'
elseif mode == 'firing' or mode == 'manual' or mode == 'stage' then
  -- Guards hold for firing, manual and stage records; on_resolved is exempt: it undoes what firing did.
  -- Cooldown is the ladder's as a whole: its stages never cool each other down.
  local cooldown, count, window = tonumber(a.cooldown_ms), tonumber(a.budget_count), tonumber(a.budget_window_ms)
  if mode == 'stage' then cooldown = 0 end
  if cooldown > 0 and redis.call('EXISTS', cooldown_key) == 1 then
    status, reason = 'skipped', 'cooldown'
  elseif count > 0 then
    redis.call('ZREMRANGEBYSCORE', budget_key, '-inf', now - window)
    if redis.call('ZCARD', budget_key) >= count then status, reason = 'skipped', 'budget_exhausted' end
  end
  if status == 'dispatched' and not dry then
    if cooldown > 0 then redis.call('SET', cooldown_key, rid, 'PX', cooldown) end
    if count > 0 then
      redis.call('ZADD', budget_key, now, rid)
      redis.call('PEXPIRE', budget_key, window)
    end
  end
  if status == 'dispatched' and tonumber(a.approval) == 1 then status = 'pending_approval' end
end
if status ~= 'skipped' and dry then status = 'dry_run' end

if mode == 'stage' then redis.call('HSET', prev_rec, 'next', rid) end
if mode == 'firing' or mode == 'stage' then
  if mode == 'firing' then redis.call('HSET', ep, 'open', a.start, 'rid', string.sub(rid, 1, 26)) end
  if status == 'pending_approval' then
    redis.call('HSET', ep, 'holds', ((redis.call('HGET', ep, 'holds') or '') .. ' ' .. rid))
  end
  redis.call('PEXPIRE', ep, a.episode_ttl_ms)
  if tonumber(a.undo) == 1 and (status == 'dispatched' or status == 'dry_run') then
    if ob_exists == nil then ob_exists = redis.call('EXISTS', ob) == 1 end
    if not ob_exists then
      redis.call('HSET', ob, 'rid', rid, 'dry', status == 'dry_run' and '1' or '0', 'seen', now)
    elseif status == 'dispatched' then
      redis.call('HSET', ob, 'dry', '0', 'seen', now)
    end
    redis.call('PEXPIRE', ob, a.episode_ttl_ms)
    redis.call('ZADD', open_z, a.ob_due_ms, a.ob_member)
  end
end

-- The whole record in one HSET (a later pair wins, as the separate writes did): status, fields, each
-- action's status, what dispatching or holding it adds, and the early decisions (its actions are pending).
local astatus = 'skipped'
if status == 'dispatched' or status == 'pending_approval' then astatus = 'pending' end
-- A playbook with no actions (TrainingHang's) is followed for its one notification, as a held record is.
local follow = tonumber(a.follow) == 1 and (status ~= 'skipped' or mode == 'stage' or reason == 'no_actions')
local early = false
if status == 'dispatched' and tonumber(a.no_live) == 1 and reason == '' then
  -- Said on the record while nothing heartbeats for the target; the command still waits until it expires.
  reason = 'no_live_target'
end
-- A skip that nobody follows gets no outcome, so it keeps no time to verify one by.
if status == 'skipped' and (not follow or reason == 'no_actions') then a.fields.verify_ms = nil end
local h = {'status', status}
-- An empty reason is left out (the reader takes a missing one as none).
if reason ~= '' then h[#h + 1] = 'reason'; h[#h + 1] = reason end
for k, v in pairs(a.fields) do h[#h + 1] = k; h[#h + 1] = v end
-- A skipped record's actions are all skipped: the reader says so (records.actions_of) without them stored.
if status ~= 'skipped' then
  for i = 0, n - 1 do h[#h + 1] = 'a:' .. i .. ':status'; h[#h + 1] = astatus end
end
if status == 'dispatched' then
  for idx, e in pairs(a.early or {}) do
    local p = 'a:' .. idx .. ':'
    early = true
    h[#h + 1] = p .. 'status'; h[#h + 1] = e[1]; h[#h + 1] = p .. 'reason'; h[#h + 1] = e[2]
    h[#h + 1] = p .. 'acked_at'; h[#h + 1] = a.at; h[#h + 1] = p .. 'result'
    h[#h + 1] = cjson.encode({message = e[3]})
  end
  h[#h + 1] = 'dispatched_ms'; h[#h + 1] = now; h[#h + 1] = 'expires_ms'; h[#h + 1] = a.expires_ms
  if tonumber(a.defer) == 1 then h[#h + 1] = 'conds'; h[#h + 1] = '1' end
  if a.command ~= '' then h[#h + 1] = 'cmd'; h[#h + 1] = a.command; h[#h + 1] = 'sig'; h[#h + 1] = a.signature end
elseif status == 'pending_approval' then
  h[#h + 1] = 'approve_by'; h[#h + 1] = a.approve_by_ms
end
-- A skipped firing record has nothing to follow (but its notification when it had no actions to run); a
-- skipped stage ends its ladder, which the reconciler says.
if follow then h[#h + 1] = 'follow'; h[#h + 1] = '1' end
redis.call('HSET', rec, unpack(h))
hist_touch(rec, metrics)
if status == 'dispatched' then
  count_backlog(rec, 1, metrics)
  if a.command ~= '' then
    redis.call('XADD', mailbox, 'MAXLEN', '~', a.maxlen, '*', 'c', a.command, 's', a.signature)
    redis.call('PUBLISH', a.channel, rid)
  end
  -- A followed record is due now (below), which is sooner than its expiry.
  if not follow then redis.call('ZADD', open_z, a.expires_ms, rid) end
elseif status == 'pending_approval' then
  if not follow then redis.call('ZADD', open_z, a.approve_by_ms, rid) end
end
if follow then redis.call('ZADD', open_z, now, rid) end
-- Every action decided already (the target can apply none of them): the record settles now. Without early
-- decisions an action is still pending, so there is nothing to settle.
if status == 'dispatched' and early then status = settle(rec, now, open_z, rid, metrics) end
redis.call('PEXPIRE', rec, a.record_ttl_ms)
redis.call('PEXPIRE', mailbox, a.record_ttl_ms)
redis.call('PEXPIRE', open_z, a.record_ttl_ms)
return {status, rid, reason}
