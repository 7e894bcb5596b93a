-- APPROVE: a person's decision on a record held for approval: release it, or reject it.
-- verb tamper: the hash no longer holds what was decided (its seal does not match, or it claims to be held
-- while the service's approvals index does not list it): nothing is sent, the record ends skipped / tampered.
-- Returns {'dispatched', counted (1: the record was counted as its node's incident, else 0)}, {'rejected'},
-- {'tampered'}, {'missing'}, {'not_pending', status} or {'expired'}.
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local state = KEYS[3]        -- the target's state (its alert's episode: field `holds`; the mailbox's count)
local ob = KEYS[4]           -- the obligation (what on_resolved must undo for this alert)
local open_z = KEYS[5]       -- the target's due items
local journal_key = KEYS[6]  -- the history journal
local metrics = KEYS[7]      -- the metrics hash
local incidents = KEYS[8]    -- the node's incident counts by playbook (Lemon nodes)
local incident_times = KEYS[9]  -- the node's recent incidents by time
-- {now (ms), at (RFC 3339), verb: approve | reject | tamper, by, comment, signature, send, expires_ms, undo (1: the
--  playbook has on_resolved actions), ob_member, ob_due_ms, episode_ttl_ms, rid, early, defer (as in DECIDE),
--  holds (the episode's field of held records), deadline (ms: the hold's, from the service's approvals index),
--  kind, playbook, incident (1: once dispatched, the record is its node's incident), incident_window_ms,
--  incident_keep_ms}
local a = cjson.decode(ARGV[1])
local ctx = {journal = journal_key, metrics = metrics, kind = a.kind}

local now = tonumber(a.now)
local h = redis.call('HMGET', rec, 'status', 'as', 'f')
if not h[1] then return {'missing'} end
local st = h[1]
if st ~= 'pending_approval' then return {'not_pending', st} end
-- Either way the record is no longer a hold of its episode.
local held = redis.call('HGET', state, a.holds)
if held then
  local holds = string.gsub(' ' .. held .. ' ', ' ' .. string.gsub(a.rid, '%p', '%%%0') .. ' ', ' ')
  redis.call('HSET', state, a.holds, holds)
end
local function finish(status, reason, code, message, fields)
  end_open(rec, code, reason, message, a.at)
  redis.call('HSET', rec, 'status', status, 'reason', reason, unpack(fields))
  journal(ctx, 'c', a.rid, 'pending_approval', status)
  done_or_follow(rec, open_z, a.rid, now, h[3])
end
if a.verb == 'tamper' then
  local why = 'Its stored decision no longer matches what was decided, so nothing was sent.'
  finish('skipped', 'tampered', 'S', why, {'detail', why, 'approval_comment', a.comment})
  return {'tampered'}
end
if now > tonumber(a.deadline) then
  finish('expired', 'approval_expired', 'E', 'Nobody approved it in time.', {})
  return {'expired'}
end
if a.verb == 'reject' then
  finish('skipped', 'rejected', 'S', 'A person rejected it.',
         {'rejected_by', a.by, 'rejected_at', a.at, 'approval_comment', a.comment})
  return {'rejected'}
end
local w = {'status', 'dispatched', 'at', now, 'exp', a.expires_ms, 'approved_by', a.by, 'approved_at', a.at,
           'approval_comment', a.comment}
local as = decide_early(h[2] or '', a.early, a.at, w)
w[#w + 1] = 'as'
w[#w + 1] = as
if tonumber(a.defer) == 1 then w[#w + 1] = 'conds'; w[#w + 1] = '1' end
if a.signature ~= '' then
  w[#w + 1] = 'sig'; w[#w + 1] = a.signature
  if a.send ~= '' then w[#w + 1] = 'send'; w[#w + 1] = a.send end
end
redis.call('HSET', rec, unpack(w))
journal(ctx, 'c', a.rid, 'pending_approval', 'dispatched')
count_backlog(ctx, 1)
if a.signature ~= '' then deliver(mailbox, state, a.rid) end
redis.call('ZADD', open_z, a.expires_ms, a.rid)
-- A followed record is looked at now (its silence is made, its conditions evaluated, when it dispatches).
if h[3] == '1' then redis.call('ZADD', open_z, now, a.rid) end
local status = settle(rec, now, open_z, a.rid, ctx)
-- A record whose every step was skipped at once changed nothing on the node: no incident.
local counted = tonumber(a.incident) == 1 and status ~= 'skipped'
if counted then
  count_incident(incidents, incident_times, a.playbook, a.rid, now, tonumber(a.incident_window_ms),
                 tonumber(a.incident_keep_ms))
end
-- A released firing record changes things the final resolve must undo.
if tonumber(a.undo) == 1 and ob then
  if redis.call('EXISTS', ob) == 0 then
    redis.call('HSET', ob, 'rid', a.rid, 'dry', '0', 'seen', now)
  else
    redis.call('HSET', ob, 'dry', '0')
  end
  redis.call('PEXPIRE', ob, a.episode_ttl_ms)
  redis.call('ZADD', open_z, a.ob_due_ms, a.ob_member)
end
return {'dispatched', counted and 1 or 0}
