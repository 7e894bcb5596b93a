-- DECIDE: guard, record and dispatch one (alert, playbook) pair atomically, in the target's hash slot
-- (DECIDE_MANY runs this once per pair, as its function decide_one; it never runs on its own).
-- Its ARGV is the pair's block of DECIDE_MANY's ARGV, by position (service/store/decide_args.py NewRecord.block).
-- Returns {status, record id, reason, first, counted}: 'duplicate', 'stale' and 'closed' mean no new record;
-- 'reach' means not decided, nothing written. first: when the reconciler is first due at the target (ms), or
-- -1; counted: 1 when the record is the node's incident (Lemon nodes), else 0.
-- `later` (DECIDE_MANY's) gathers the writes its pairs share.
--
-- The target's state (one hash, keys.target_state) holds, for each playbook PB and alert fingerprint FP, the
-- alert's episode: PB|FP|open (start of the open episode), |closed (latest start of a closed one, a tombstone),
-- |hi (the latest start seen while open), |rid (the open episode's record, its id's head), |holds (records held
-- for approval), and what a resolve left: |res_start, |res_ms, |res_at; the playbook's guards there: PB|cool (ms
-- until which it cools down) and PB|runs (when it dispatched within max_runs' window); and the target's own:
-- q (commands waiting in its mailbox: a new one past the bound is skipped / mailbox_full) and x (until when
-- the hash's TTL runs, so that a write extends it about once a day, not every time). One HMGET reads what a
-- firing alert needs, one HSET writes it.
-- The obligation hash (rid, dry, seen) says that a firing record changed something that the final resolve
-- must undo, whichever episode it belonged to. An escalation stage (mode stage) is a record of the open
-- episode made by the reconciler: once per previous record (its `next`), never after the episode closed, never
-- held back by cooldown.
-- The heartbeat: with hb = 1, DECIDE reads it instead of the service (one round trip less). No heartbeat:
-- no_live. A heartbeat that lists every action of `need` (the command was signed with all of them): as sent.
-- Anything else (an action it lacks, no list, not JSON): {'reach', ...} before any write, and the service
-- decides that pair again with the heartbeat read and the command made to fit.
local rec = KEYS[1]            -- the record
local mailbox = KEYS[2]        -- the target's mailbox
local state = KEYS[3]          -- the target's state: episodes, guards, the mailbox's count
local ob = KEYS[4]             -- the obligation (what on_resolved must undo for this alert)
local open_z = KEYS[5]         -- the target's due items
local prev_rec = KEYS[6]       -- the ladder's previous record (mode stage; else the record again)
local heartbeat = KEYS[7]      -- the target's heartbeat (read with hb = 1)
local journal_key = KEYS[8]    -- the history journal
local metrics = KEYS[9]        -- the metrics hash
local incidents = KEYS[10]     -- the node's incident counts by playbook (Lemon nodes)
local incident_times = KEYS[11]  -- the node's recent incidents by time
local now = tonumber(ARGV[1])       -- ms
local mode = ARGV[2]                 -- firing | resolved | timeout | manual | stage
local start = ARGV[3]                -- the episode's start (second precision)
local rid = ARGV[4]                  -- the record's id
local forced_reason = ARGV[5]        -- '' or why the record is skipped
local cooldown_ms = tonumber(ARGV[6])  -- the playbook's cooldown (0: none)
local budget_count = tonumber(ARGV[7])  -- max_runs' count (0: none)
local budget_window_ms = tonumber(ARGV[8])  -- max_runs' window
local approval = ARGV[9] == '1'      -- the playbook holds its records for approval
local dry = ARGV[10] == '1'          -- dry run: record, dispatch nothing
local undo = ARGV[11] == '1'         -- the playbook has on_resolved actions
local episode_ttl_ms = ARGV[12]      -- the obligation's TTL
local state_ttl_ms = tonumber(ARGV[13])  -- how long the state must outlive this write
local mailbox_max = tonumber(ARGV[14])   -- commands a mailbox holds waiting at most
local signature = ARGV[15]           -- the command's signature ('' when nothing is sent now)
local expires_ms = ARGV[16]          -- when the command expires
local approve_by_ms = ARGV[17]       -- when a hold expires
local ob_member = ARGV[18]           -- the obligation's member among the due items
local ob_due_ms = ARGV[19]           -- when the obligation is due without a resolve
local n = tonumber(ARGV[20])         -- the record's actions
local follow_arg = ARGV[21] == '1'   -- the reconciler follows the record
local ends_at = ARGV[22]             -- a resolve's endsAt
local ends_ms = ARGV[23]             -- the same, ms
local early_json = ARGV[24]          -- early decisions (JSON {index: [status, reason, message]}), or ''
local no_live = ARGV[25] == '1'      -- nothing heartbeats for the target (when not read here)
local defer = ARGV[26] == '1'        -- `when:` conditions first; the reconciler sends the command
local hb = ARGV[27] == '1'           -- read the heartbeat here
local need = ARGV[28]                -- the actions the command was signed with, space-separated
local label = ARGV[29]               -- the target's label (the due-targets index)
local follow_now = ARGV[30] == '1'   -- a new followed record is due at once
local later_ms = ARGV[31]            -- when a dispatched or held record is due otherwise
local verify_ms = ARGV[32]           -- the record's verify time ('' for none)
local fp = ARGV[33]                  -- the alert's fingerprint
local pb = ARGV[34]                  -- the playbook
local alertname = ARGV[35]           -- the alert's name (the history index)
local send = ARGV[36]                -- the actions the command holds ('' all; else their indexes, space-separated)
local at = ARGV[37]                  -- now as RFC 3339
local decided = ARGV[38]             -- what was decided (the record's `d`)
local seal = ARGV[39]                -- its seal
local kind = ARGV[40]                -- the target's kind
local incident = ARGV[41] == '1'     -- a dispatched record is the node's incident (a firing node record)
local incident_window_ms = tonumber(ARGV[42])  -- how long the node's recent incidents are kept
local incident_keep_ms = tonumber(ARGV[43])    -- how long the node's counts outlive its last incident
local extra = {unpack(ARGV, 44)}     -- more fields of the record, name then value
local later = ...                    -- DECIDE_MANY's shared writes
local reason = ''
local ctx = {journal = journal_key, metrics = metrics, kind = kind}
local counted = false  -- the record was counted as the node's incident

if hb then
  local raw = redis.call('GET', heartbeat)
  if not raw then
    no_live = true
  else
    local ok, beat = pcall(cjson.decode, raw)
    local listed = ok and type(beat) == 'table' and beat.actions
    if type(listed) ~= 'table' then return {'reach', '', '', -1, 0} end
    local have = {}
    for _, x in ipairs(listed) do have[x] = true end
    for x in string.gmatch(need, '%S+') do
      if not have[x] then return {'reach', '', '', -1, 0} end
    end
  end
end

-- The pair's answer, and what it adds to the indexes (DECIDE_MANY writes them): when the reconciler first
-- looks at the target: now for a new followed record that has a silence, a notification or conditions to do
-- (or nothing dispatched to wait for), and for a resolve; else at the record's expiry or deadline (an ack
-- brings that forward); never for the rest. A new record is journaled with what the history index needs of it;
-- an older record answered with is journaled again, so the history lists it again (that heals a listing lost
-- to a crash).
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
  local j = later.journal[journal_key] or {}
  later.journal[journal_key] = j
  if new then
    j[#j + 1] = 'n|' .. id .. '|' .. pb .. '|' .. alertname
  elseif id ~= '' then
    j[#j + 1] = 'h|' .. id
  end
  if held then
    table.insert(later.approvals, approve_by_ms)
    table.insert(later.approvals, id)
  end
  if first and (later.due[label] == nil or first < later.due[label]) then later.due[label] = first end
  if counted then later.nodes[string.sub(label, #kind + 2)] = now end
  return {status, id, why, first or -1, counted and 1 or 0}
end

-- An episode field's name in the state hash.
local function e(name) return pb .. '|' .. fp .. '|' .. name end

local prefix = string.sub(rec, 1, #rec - #rid)
-- The episode keeps its record's time-sortable head only (26 characters): the rest names the target.
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

-- The state outlives every write by the longest of its playbooks' episode tombstones, cooldowns and budget
-- windows; extended about once a day (x says until when it runs), not at every write. `writes`: the fields
-- this write sets, which the mark joins (one HSET).
local function keep_state(x, writes)
  local h = writes or {}
  local until_ms
  if now + state_ttl_ms > tonumber(x or '0') then
    until_ms = now + state_ttl_ms + 86400000
    h[#h + 1] = 'x'; h[#h + 1] = until_ms
  end
  if #h > 0 then redis.call('HSET', state, unpack(h)) end
  if until_ms then redis.call('PEXPIRE', state, until_ms - now) end
end

local function close_episode()
  local oc = redis.call('HMGET', state, e('open'), e('closed'), e('hi'), e('holds'), 'x')
  local open, closed, holds = oc[1], oc[2], oc[4]
  local last = latest_start(open, oc[3])
  if last and (not closed or last > closed) then redis.call('HSET', state, e('closed'), last) end
  if mode == 'resolved' and open then
    redis.call('HSET', state, e('res_start'), open, e('res_ms'), ends_ms, e('res_at'), ends_at)
    -- The episode's ladder (its first record, then each `next`) learns of the resolve at once.
    local r, hops = ep_rid(), 0
    while r and r ~= '' and hops < 64 do
      local h = redis.call('HMGET', prefix .. r, 'f', 'next')
      if h[1] == '1' then redis.call('ZADD', open_z, now, r) end
      r, hops = h[2], hops + 1
    end
  end
  redis.call('HDEL', state, e('open'), e('rid'), e('hi'))
  -- The alert is over: a hold that nobody approved must not throttle a GPU that nothing will restore.
  if holds then
    for held in string.gmatch(holds, '%S+') do
      local hrec = prefix .. held
      local h = redis.call('HMGET', hrec, 'status', 'f')
      if h[1] == 'pending_approval' then
        end_open(hrec, 'E', 'resolved_before_approval', 'The alert resolved before anyone approved it.', at)
        redis.call('HSET', hrec, 'status', 'expired', 'reason', 'resolved_before_approval')
        journal(ctx, 'c', held, 'pending_approval', 'expired')
        table.insert(later.unheld, held)
        done_or_follow(hrec, open_z, held, now, h[2])
      end
    end
    redis.call('HDEL', state, e('holds'))
  end
  keep_state(oc[5])
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
-- The guards, the mailbox's count and the TTL mark when the firing read has them; the state's writes, in one HSET.
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
  local oc = redis.call('HMGET', state, e('open'), e('closed'), e('hi'), pb .. '|cool', pb .. '|runs', 'q', 'x')
  local open, closed = oc[1], oc[2]
  local top = latest_start(open, oc[3])
  guards = {oc[4], oc[5], oc[6], oc[7]}
  if open and start <= top then
    -- The open episode: a resend, a retry, an HA peer; an earlier start is the same alert merged from
    -- two Prometheus servers (never one of a closed episode's, which is a late retry of that episode).
    -- The episode keeps its latest start too (hi), so a late retry with the start from before the merge is
    -- still this episode, while it is open and after it closed.
    if start < open and (not closed or start > closed) then redis.call('HSET', state, e('open'), start, e('hi'), top) end
    keep_state(oc[7])
    return answer('duplicate', ep_rid() or '', '')
  end
  if closed and start <= closed then
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

local g = guards or redis.call('HMGET', state, pb .. '|cool', pb .. '|runs', 'q', 'x')
-- The guards a dispatch spends (cooldown, budget), written only if it is dispatched or held.
local spend = {}
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
      if cooldown > 0 then spend[#spend + 1] = pb .. '|cool'; spend[#spend + 1] = now + cooldown end
      if budget_count > 0 then
        runs[#runs + 1] = now
        spend[#spend + 1] = pb .. '|runs'; spend[#spend + 1] = table.concat(runs, ' ')
      end
    end
  end
  if status == 'dispatched' and approval then status = 'pending_approval' end
end
if status ~= 'skipped' and dry then status = 'dry_run' end
-- A command that goes out now needs room in the mailbox: never trimmed, it holds at most mailbox_max waiting.
local sending = status == 'dispatched' and signature ~= ''
if sending and tonumber(g[3] or '0') >= mailbox_max then
  -- Its guards are not spent: it was not dispatched.
  status, reason, sending = 'skipped', 'mailbox_full', false
end
if status == 'dispatched' or status == 'pending_approval' then
  for _, x in ipairs(spend) do writes[#writes + 1] = x end
end

if mode == 'stage' then redis.call('HSET', prev_rec, 'next', rid) end
if mode == 'firing' then
  writes[#writes + 1] = e('open'); writes[#writes + 1] = start
  writes[#writes + 1] = e('rid'); writes[#writes + 1] = string.sub(rid, 1, 26)
end
if (mode == 'firing' or mode == 'stage') and status == 'pending_approval' then
  writes[#writes + 1] = e('holds')
  writes[#writes + 1] = (redis.call('HGET', state, e('holds')) or '') .. ' ' .. rid
end
if sending then writes[#writes + 1] = 'q'; writes[#writes + 1] = tonumber(g[3] or '0') + 1 end
if #writes > 0 then keep_state(g[4], writes) end
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

-- The whole record in one HSET: what was decided, its seal, its status, and what dispatching or holding it adds.
-- A playbook with no actions (TrainingHang's) is followed for its one notification, as a held record is.
local follow = follow_arg and (status ~= 'skipped' or mode == 'stage' or reason == 'no_actions')
if status == 'dispatched' and no_live and reason == '' then
  -- Said on the record while nothing heartbeats for the target; the command still waits until it expires.
  reason = 'no_live_target'
end
-- A skip that nobody follows gets no outcome, so it keeps no time to verify one by.
if status == 'skipped' and (not follow or reason == 'no_actions') then verify_ms = '' end
local h = {'d', decided, 'seal', seal, 'status', status}
for _, x in ipairs(extra) do h[#h + 1] = x end
if reason ~= '' then h[#h + 1] = 'reason'; h[#h + 1] = reason end
if verify_ms ~= '' then h[#h + 1] = 'v'; h[#h + 1] = verify_ms end
local early = false
if status == 'dispatched' or status == 'pending_approval' then
  -- A skipped record stores no action statuses: each is skipped (the reader says so).
  local as = string.rep('P', n)
  if status == 'dispatched' and early_json ~= '' then
    local before = as
    as = decide_early(as, cjson.decode(early_json), at, h)
    early = as ~= before
  end
  h[#h + 1] = 'as'; h[#h + 1] = as
end
if status == 'dispatched' then
  h[#h + 1] = 'exp'; h[#h + 1] = expires_ms
  if defer then h[#h + 1] = 'conds'; h[#h + 1] = '1' end
  if sending then
    h[#h + 1] = 'sig'; h[#h + 1] = signature
    if send ~= '' then h[#h + 1] = 'send'; h[#h + 1] = send end
  end
elseif status == 'pending_approval' then
  h[#h + 1] = 'ab'; h[#h + 1] = approve_by_ms
end
if follow then h[#h + 1] = 'f'; h[#h + 1] = '1' end
redis.call('HSET', rec, unpack(h))
if status == 'dispatched' then
  later.backlog[metrics] = later.backlog[metrics] or {}
  later.backlog[metrics][kind] = (later.backlog[metrics][kind] or 0) + 1
  -- The entry names the record (its id's head), which holds what the command is made of and its signature;
  -- the state's `q` counted it above.
  if sending then redis.call('XADD', mailbox, '*', 'r', string.sub(rid, 1, 26)) end
  -- Due at its expiry through the due targets (DECIDE_MANY); a followed one is in its due items too (below).
elseif status == 'pending_approval' then
  if not follow then redis.call('ZADD', open_z, approve_by_ms, rid) end
end
-- A followed record is due now when it has a silence, a notification or conditions to do, or nothing to wait
-- for; one still dispatched or held waits for its ack (which settles it and makes it due), expiry or deadline.
if follow then
  local waits = not follow_now and (status == 'dispatched' or status == 'pending_approval')
  redis.call('ZADD', open_z, waits and later_ms or now, rid)
end
-- Every action decided already (the target can apply none of them): the record settles now. Without early
-- decisions an action is still pending, so there is nothing to settle.
local dispatched = status == 'dispatched'
if dispatched and early then
  status = settle(rec, now, open_z, rid, ctx)
end
-- A record whose every step was skipped at once changed nothing on the node: no incident.
if incident and dispatched and status ~= 'skipped' then
  count_incident(incidents, incident_times, pb, rid, now, incident_window_ms, incident_keep_ms)
  counted = true
end
return answer(status, rid, reason)
