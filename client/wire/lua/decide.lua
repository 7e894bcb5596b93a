-- DECIDE: guard, record and dispatch one (alert, playbook) pair atomically, in the target's hash slot (DECIDE_MANY
-- runs this once per pair, as its function decide_one; it never runs on its own).
-- Its ARGV is the pair's block of DECIDE_MANY's ARGV, by position (records.py NewRecord.block): now (ms), at
-- (now as RFC 3339), mode (firing | resolved | timeout | manual | stage), start (episode start, second
-- precision), rid, forced_reason ('' or why it is skipped), cooldown_ms, budget_count, budget_window_ms,
-- approval (0/1), dry (0/1), undo (1: the playbook has on_resolved actions), record_ttl_ms, episode_ttl_ms,
-- maxlen, channel, command, signature, expires_ms, approve_by_ms, ob_member, ob_due_ms, n, follow (0/1: the
-- reconciler follows the record), ends_at (a resolve's endsAt), ends_ms, early (JSON {index: [status, reason,
-- message]}: actions the live target cannot apply, or ''), no_live (1: no live target heartbeats), defer (1:
-- `when:` conditions first; the reconciler sends the command), hb (1: read the heartbeat), need (the actions
-- the command was signed with, space-separated), label (the target's), follow_now (0/1: a new followed record
-- is looked at now: it has a silence, a notification or conditions to do), later_ms (when a dispatched or
-- held record is due otherwise), approve_by_s (the approvals index's score), verify_ms ('' for none), fp,
-- state_ttl_ms, then the record's fields as name, value, name, value...
-- Positional strings, not JSON: decoding ~2.6 KB of JSON a pair was a good part of a call.
-- Returns {status, record id, reason, first}: 'duplicate', 'stale' and 'closed' mean no new record; 'reach'
-- means not decided, nothing written. first: when the reconciler is first due at the target (ms), or -1.
-- `later` (DECIDE_MANY's) gathers the writes its pairs share (common.lua later_flush).
--
-- Episodes (one remediation per firing episode): an alert's episode, in its playbook's state hash (fields
-- fp|name, keys.episode_fields), holds `open` (start of the open episode), `closed` (latest start of a closed
-- one, kept as a tombstone), `rid` (the open episode's record, its head: ep_rid) and `holds` (records held
-- for approval); a resolve leaves `res_start`, `res_ms` and `res_at` (the closed episode's start and its
-- endsAt), from which the reconciler decides outcomes. The same hash holds the playbook's guards on the
-- target: `cool` (ms until which it cools down) and `runs` (when it dispatched within max_runs' window). One
-- HMGET reads what a firing alert needs, one HSET writes it. The obligation hash (rid, dry,
-- seen) says that a firing record changed something that the final resolve must undo, whichever episode
-- it belonged to. An escalation stage (mode stage) is a record of the open episode made by the reconciler:
-- once per previous record (its `next`), never after the episode closed, never held back by cooldown.
-- The heartbeat: with hb = 1, DECIDE reads it instead of the service (one round trip less). No heartbeat:
-- no_live. A heartbeat that lists every action of `need` (the command was signed with all of them): as sent.
-- Anything else (an action it lacks, no list, not JSON): {'reach', '', ''} before any write, and the service
-- decides that pair again with the heartbeat read and the command made to fit.
local rec = KEYS[1]            -- the record
local mailbox = KEYS[2]        -- the target's mailbox
local state = KEYS[3]          -- the playbook's state on the target: its guards and its alerts' episodes
local ob = KEYS[4]             -- the obligation (what on_resolved must undo for this alert)
local open_z = KEYS[5]         -- the target's due items
local prev_rec = KEYS[6]       -- the ladder's previous record (mode stage; else the record again)
local metrics = KEYS[7]        -- the metrics hash (common.lua)
local heartbeat = KEYS[8]      -- the target's heartbeat (read with hb = 1)
local now = tonumber(ARGV[1])       -- ms
local at = ARGV[2]                   -- now as RFC 3339
local mode = ARGV[3]                 -- firing | resolved | timeout | manual | stage
local start = ARGV[4]                -- the episode's start (second precision)
local rid = ARGV[5]                  -- the record's id
local forced_reason = ARGV[6]        -- '' or why the record is skipped
local cooldown_ms = tonumber(ARGV[7])  -- the playbook's cooldown (0: none)
local budget_count = tonumber(ARGV[8])  -- max_runs' count (0: none)
local budget_window_ms = tonumber(ARGV[9])  -- max_runs' window
local approval = ARGV[10] == '1'     -- the playbook holds its records for approval
local dry = ARGV[11] == '1'          -- dry run: record, dispatch nothing
local undo = ARGV[12] == '1'         -- the playbook has on_resolved actions
local record_ttl_ms = ARGV[13]       -- the record's TTL (and its mailbox's, due items')
local episode_ttl_ms = ARGV[14]      -- the episode's and obligation's TTL
local maxlen = ARGV[15]              -- the mailbox's approximate length cap
local channel = ARGV[16]             -- the target's wake-up channel
local command = ARGV[17]             -- the signed command ('' when nothing is sent now)
local signature = ARGV[18]           -- its signature
local expires_ms = ARGV[19]          -- when the command expires
local approve_by_ms = ARGV[20]       -- when a hold expires
local ob_member = ARGV[21]           -- the obligation's member among the due items
local ob_due_ms = ARGV[22]           -- when the obligation is due without a resolve
local n = tonumber(ARGV[23])         -- the record's actions
local follow_arg = ARGV[24] == '1'   -- the reconciler follows the record
local ends_at = ARGV[25]             -- a resolve's endsAt
local ends_ms = ARGV[26]             -- the same, ms
local early_json = ARGV[27]          -- early decisions (JSON), or ''
local no_live = ARGV[28] == '1'      -- nothing heartbeats for the target (when not read here)
local defer = ARGV[29] == '1'        -- `when:` conditions first
local hb = ARGV[30] == '1'           -- read the heartbeat here
local need = ARGV[31]                -- the actions the command was signed with, space-separated
local label = ARGV[32]               -- the target's label (the due-targets index)
local follow_now = ARGV[33] == '1'   -- a new followed record is due at once
local later_ms = ARGV[34]            -- when a dispatched or held record is due otherwise
local approve_by_s = ARGV[35]        -- the approvals index's score
local verify_ms = ARGV[36]           -- the record's verify time ('' for none)
local fp = ARGV[37]                  -- the alert's fingerprint: its episode's fields in the state are fp|name
local state_ttl_ms = ARGV[38]        -- the state's TTL: the longest of the episodes', the cooldown's, the budget's
local fields = {unpack(ARGV, 39)}    -- the record's fields, name then value
local later = ...                    -- DECIDE_MANY's shared writes (common.lua later_flush)
local reason = ''

if hb then
  local raw = redis.call('GET', heartbeat)
  if not raw then
    no_live = true
  else
    local ok, beat = pcall(cjson.decode, raw)
    local listed = ok and type(beat) == 'table' and beat.actions
    if type(listed) ~= 'table' then return {'reach', '', '', -1} end
    local have = {}
    for _, x in ipairs(listed) do have[x] = true end
    for x in string.gmatch(need, '%S+') do
      if not have[x] then return {'reach', '', '', -1} end
    end
  end
end

-- The pair's answer, and what it adds to the indexes (DECIDE_MANY writes them): when the reconciler first
-- looks at the target: now for a new followed record that has a silence, a notification or conditions to do
-- (or nothing dispatched to wait for), and for a resolve; else at the record's expiry or deadline (an ack
-- brings that forward); never for the rest. An older record answered with is journaled again, so the
-- history lists it again (that heals a listing lost to a crash).
local function answer(status, id, why)
  local new = id ~= '' and status ~= 'duplicate' and status ~= 'stale' and status ~= 'closed'
  local held = status == 'pending_approval'
  local first = nil
  if (follow_arg and new and (follow_now or (status ~= 'dispatched' and not held)))
      or (mode == 'resolved' and status ~= 'stale') then
    first = now
  elseif status == 'dispatched' or held or (undo and status == 'dry_run') then
    first = tonumber(later_ms)
  end
  if id ~= '' and not new then table.insert(later.history, id) end
  if held then
    table.insert(later.approvals, approve_by_s)
    table.insert(later.approvals, id)
  end
  if first and (later.due[label] == nil or first < later.due[label]) then later.due[label] = first end
  return {status, id, why, first or -1}
end

-- An episode field's name in the state hash.
local function e(name) return fp .. '|' .. name end

local prefix = string.sub(rec, 1, #rec - #rid)
-- The episode keeps its record's time-sortable head only (26 characters): the rest names the target, whose
-- key the episode is. One written before keeps the whole id.
local function ep_rid()
  local r = redis.call('HGET', state, e('rid'))
  if r and #r == 26 then return r .. string.sub(rid, 27) end
  return r
end

-- The later of an episode's open start and the latest start it has seen (hi: before a merge moved it earlier).
local function latest_start(open, hi)
  if open and hi and hi > open then return hi end
  return open
end

local function close_episode()
  local oc = redis.call('HMGET', state, e('open'), e('closed'), e('hi'), e('holds'))
  local open, closed, holds = oc[1], oc[2], oc[4]
  local last = latest_start(open, oc[3])
  if last and (not closed or last > closed) then redis.call('HSET', state, e('closed'), last) end
  if mode == 'resolved' and open then
    redis.call('HSET', state, e('res_start'), open, e('res_ms'), ends_ms, e('res_at'), ends_at)
    -- The episode's ladder (its first record, then each `next`) learns of the resolve at once.
    local r, hops = ep_rid(), 0
    while r and r ~= '' and hops < 64 do
      if redis.call('HGET', prefix .. r, 'follow') == '1' then redis.call('ZADD', open_z, now, r) end
      r, hops = redis.call('HGET', prefix .. r, 'next'), hops + 1
    end
  end
  redis.call('HDEL', state, e('open'), e('rid'), e('hi'))
  -- The alert is over: a hold that nobody approved must not throttle a GPU that nothing will restore.
  if holds then
    for held in string.gmatch(holds, '%S+') do
      local hrec = prefix .. held
      if redis.call('HGET', hrec, 'status') == 'pending_approval' then
        end_open(hrec, 'expired', 'resolved_before_approval', 'The alert resolved before anyone approved it.', at)
        redis.call('HSET', hrec, 'status', 'expired', 'reason', 'resolved_before_approval')
        hist_touch(hrec, metrics)
        done_or_follow(hrec, open_z, held, now)
      end
    end
    redis.call('HDEL', state, e('holds'))
  end
  redis.call('PEXPIRE', state, state_ttl_ms)
end

-- Take the undo obligation for a resolve; false when nothing was changed that needs undoing.
local function discharge()
  if redis.call('EXISTS', ob) == 0 then return false end
  if redis.call('HGET', ob, 'dry') == '1' then dry = true end
  redis.call('DEL', ob)
  redis.call('ZREM', open_z, ob_member)
  return true
end

-- Whether the obligation exists, read once (nothing between the two reads of a firing decide changes it).
local ob_exists = nil
-- The guards (cool, runs) when the firing read already has them; the state's writes, made in one HSET.
local guards = nil
local writes = {}
if mode == 'firing' then
  -- Every firing notification, a resend too, says the alert still fires: resolve_timeout counts from here.
  -- Only a playbook with on_resolved actions makes obligations.
  if undo then ob_exists = redis.call('EXISTS', ob) == 1 end
  if ob_exists then
    redis.call('HSET', ob, 'seen', now)
    redis.call('ZADD', open_z, ob_due_ms, ob_member)
  end
  local oc = redis.call('HMGET', state, e('open'), e('closed'), e('hi'), 'cool', 'runs')
  local open, closed = oc[1], oc[2]
  local top = latest_start(open, oc[3])
  guards = {oc[4], oc[5]}
  if open and start <= top then
    -- The open episode: a resend, a retry, an HA peer; an earlier start is the same alert merged from
    -- two Prometheus servers (never one of a closed episode's, which is a late retry of that episode).
    -- The episode keeps its latest start too (hi), so a late retry with the start from before the merge is
    -- still this episode, while it is open and after it closed.
    if start < open and (not closed or start > closed) then redis.call('HSET', state, e('open'), start, e('hi'), top) end
    redis.call('PEXPIRE', state, state_ttl_ms)
    return answer('duplicate', ep_rid() or '', '')
  end
  if closed and start <= closed then
    redis.call('PEXPIRE', state, state_ttl_ms)
    return answer('duplicate', '', 'closed_episode')
  end
  if open then
    -- A later start while one is open: the alert resolved and fired again within one group_interval, so
    -- Alertmanager never sent that resolve. The old episode is over; its obligation stays with the alert.
    writes[#writes + 1] = e('closed')
    writes[#writes + 1] = top
    redis.call('HDEL', state, e('hi'))
  end
elseif mode == 'resolved' or mode == 'timeout' then
  local open = redis.call('HGET', state, e('open'))
  if mode == 'resolved' and (not open or open > start) then
    -- No open episode, or a stale resolve of an older one: it must not close (or undo) a newer episode.
    return answer('stale', '', '')
  end
  close_episode()
  if not discharge() or n == 0 then return answer('closed', '', '') end
  if mode == 'timeout' then reason = 'resolved_not_notified' end
elseif mode == 'stage' then
  local prev = redis.call('HGET', prev_rec, 'next')
  if prev and prev ~= '' then return answer('duplicate', prev, '') end
  local open = redis.call('HGET', state, e('open'))
  -- The episode resolved, or a later one replaced it: the ladder is over.
  if not open or open > start then return answer('closed', '', '') end
end

local status = 'dispatched'
if forced_reason ~= '' then
  status, reason = 'skipped', forced_reason
elseif n == 0 then
  status, reason = 'skipped', 'no_actions'
elseif mode == 'firing' or mode == 'manual' or mode == 'stage' then
  -- Guards hold for firing, manual and stage records; on_resolved is exempt: it undoes what firing did.
  -- Cooldown is the ladder's as a whole: its stages never cool each other down.
  local cooldown = cooldown_ms
  if mode == 'stage' then cooldown = 0 end
  if cooldown > 0 or budget_count > 0 then
    local g = guards or redis.call('HMGET', state, 'cool', 'runs')
    local runs = {}
    for t in string.gmatch(g[2] or '', '%d+') do
      if tonumber(t) > now - budget_window_ms then runs[#runs + 1] = t end
    end
    if cooldown > 0 and tonumber(g[1] or '0') > now then
      status, reason = 'skipped', 'cooldown'
    elseif budget_count > 0 and #runs >= budget_count then
      status, reason = 'skipped', 'budget_exhausted'
    end
    if status == 'dispatched' and not dry then
      if cooldown > 0 then writes[#writes + 1] = 'cool'; writes[#writes + 1] = now + cooldown end
      if budget_count > 0 then
        runs[#runs + 1] = now
        writes[#writes + 1] = 'runs'; writes[#writes + 1] = table.concat(runs, ' ')
      end
    end
  end
  if status == 'dispatched' and approval then status = 'pending_approval' end
end
if status ~= 'skipped' and dry then status = 'dry_run' end

if mode == 'stage' then redis.call('HSET', prev_rec, 'next', rid) end
if mode == 'firing' then
  writes[#writes + 1] = e('open'); writes[#writes + 1] = start
  writes[#writes + 1] = e('rid'); writes[#writes + 1] = string.sub(rid, 1, 26)
end
if (mode == 'firing' or mode == 'stage') and status == 'pending_approval' then
  writes[#writes + 1] = e('holds')
  writes[#writes + 1] = (redis.call('HGET', state, e('holds')) or '') .. ' ' .. rid
end
if #writes > 0 then redis.call('HSET', state, unpack(writes)) end
if #writes > 0 or mode == 'stage' then redis.call('PEXPIRE', state, state_ttl_ms) end
if mode == 'firing' or mode == 'stage' then
  if undo and (status == 'dispatched' or status == 'dry_run') then
    if ob_exists == nil then ob_exists = redis.call('EXISTS', ob) == 1 end
    if not ob_exists then
      redis.call('HSET', ob, 'rid', rid, 'dry', status == 'dry_run' and '1' or '0', 'seen', now)
    elseif status == 'dispatched' then
      redis.call('HSET', ob, 'dry', '0', 'seen', now)
    end
    redis.call('PEXPIRE', ob, episode_ttl_ms)
    redis.call('ZADD', open_z, ob_due_ms, ob_member)
  end
end

-- The whole record in one HSET (a later pair wins, as the separate writes did): status, fields, each
-- action's status, what dispatching or holding it adds, and the early decisions (its actions are pending).
local astatus = 'skipped'
if status == 'dispatched' or status == 'pending_approval' then astatus = 'pending' end
-- A playbook with no actions (TrainingHang's) is followed for its one notification, as a held record is.
local follow = follow_arg and (status ~= 'skipped' or mode == 'stage' or reason == 'no_actions')
local early = false
if status == 'dispatched' and no_live and reason == '' then
  -- Said on the record while nothing heartbeats for the target; the command still waits until it expires.
  reason = 'no_live_target'
end
-- A skip that nobody follows gets no outcome, so it keeps no time to verify one by.
if status == 'skipped' and (not follow or reason == 'no_actions') then verify_ms = '' end
local h = fields
h[#h + 1] = 'status'; h[#h + 1] = status
-- An empty reason is left out (the reader takes a missing one as none).
if reason ~= '' then h[#h + 1] = 'reason'; h[#h + 1] = reason end
if verify_ms ~= '' then h[#h + 1] = 'verify_ms'; h[#h + 1] = verify_ms end
-- A skipped record's actions are all skipped: the reader says so (records.actions_of) without them stored.
if status ~= 'skipped' then
  for i = 0, n - 1 do h[#h + 1] = 'a:' .. i .. ':status'; h[#h + 1] = astatus end
end
if status == 'dispatched' then
  for idx, e in pairs(early_json ~= '' and cjson.decode(early_json) or {}) do
    local p = 'a:' .. idx .. ':'
    early = true
    h[#h + 1] = p .. 'status'; h[#h + 1] = e[1]; h[#h + 1] = p .. 'reason'; h[#h + 1] = e[2]
    h[#h + 1] = p .. 'acked_at'; h[#h + 1] = at; h[#h + 1] = p .. 'result'
    h[#h + 1] = cjson.encode({message = e[3]})
  end
  h[#h + 1] = 'dispatched_ms'; h[#h + 1] = now; h[#h + 1] = 'expires_ms'; h[#h + 1] = expires_ms
  if defer then h[#h + 1] = 'conds'; h[#h + 1] = '1' end
  if command ~= '' then h[#h + 1] = 'cmd'; h[#h + 1] = command; h[#h + 1] = 'sig'; h[#h + 1] = signature end
elseif status == 'pending_approval' then
  h[#h + 1] = 'approve_by'; h[#h + 1] = approve_by_ms
end
-- A skipped firing record has nothing to follow (but its notification when it had no actions to run); a
-- skipped stage ends its ladder, which the reconciler says.
if follow then h[#h + 1] = 'follow'; h[#h + 1] = '1' end
redis.call('HSET', rec, unpack(h))
later_touch(later, rec, metrics)
if status == 'dispatched' then
  later_backlog(later, rec, 1, metrics)
  if command ~= '' then
    -- The entry names the record, which holds the signed command: stored once (lua/claim.lua, mailbox.py).
    redis.call('XADD', mailbox, 'MAXLEN', '~', maxlen, '*', 'r', rid)
    redis.call('PUBLISH', channel, rid)
  end
  -- A followed record is due now (below), which is sooner than its expiry.
  if not follow then redis.call('ZADD', open_z, expires_ms, rid) end
elseif status == 'pending_approval' then
  if not follow then redis.call('ZADD', open_z, approve_by_ms, rid) end
end
if follow then redis.call('ZADD', open_z, now, rid) end
-- Every action decided already (the target can apply none of them): the record settles now. Without early
-- decisions an action is still pending, so there is nothing to settle.
if status == 'dispatched' and early then status = settle(rec, now, open_z, rid, metrics) end
redis.call('PEXPIRE', rec, record_ttl_ms)
later_expire(later, mailbox, record_ttl_ms)
later_expire(later, open_z, record_ttl_ms)
return answer(status, rid, reason)
