-- APPROVE: a person's decision on a record held for approval: release it, or reject it.
-- verb tamper: a person approved, but the hash no longer holds what was decided (its seal does not match):
-- nothing is sent, the record ends skipped / tampered.
-- Returns {'dispatched'}, {'rejected'}, {'tampered'}, {'missing'}, {'not_pending', status} or {'expired'}.
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local state = KEYS[3]        -- the playbook's state on the target (its alert's episode: field `holds`)
local ob = KEYS[4]           -- the obligation (what on_resolved must undo for this alert)
local open_z = KEYS[5]       -- the target's due items
local metrics = KEYS[6]      -- the metrics hash (common.lua)
-- {now (ms), at (RFC 3339), verb: approve | reject | tamper, by, comment, maxlen, channel, command, signature,
--  expires_ms, undo (1: the playbook has on_resolved actions), ob_member, ob_due_ms, episode_ttl_ms, rid, early,
--  defer (as in DECIDE), holds (the episode's field of held records)}
local a = cjson.decode(ARGV[1])

local now = tonumber(a.now)
if redis.call('EXISTS', rec) == 0 then return {'missing'} end
local st = redis.call('HGET', rec, 'status')
if st ~= 'pending_approval' then return {'not_pending', st} end
hist_touch(rec, metrics)  -- every path below changes its status
if now > tonumber(redis.call('HGET', rec, 'approve_by') or '0') then
  end_open(rec, 'expired', 'approval_expired', 'Nobody approved it in time.', a.at)
  redis.call('HSET', rec, 'status', 'expired', 'reason', 'approval_expired')
  done_or_follow(rec, open_z, a.rid, now)
  return {'expired'}
end
-- Either way the record is no longer a hold of its episode.
local held = redis.call('HGET', state, a.holds)
if held then
  local holds = string.gsub(' ' .. held .. ' ', ' ' .. string.gsub(a.rid, '%p', '%%%0') .. ' ', ' ')
  redis.call('HSET', state, a.holds, holds)
end
if a.verb == 'reject' then
  end_open(rec, 'skipped', 'rejected', 'A person rejected it.', a.at)
  redis.call('HSET', rec, 'status', 'skipped', 'reason', 'rejected', 'rejected_by', a.by, 'rejected_at', a.at,
             'approval_comment', a.comment)
  done_or_follow(rec, open_z, a.rid, now)
  return {'rejected'}
end
if a.verb == 'tamper' then
  local why = 'Its stored steps no longer match what was decided, so nothing was sent.'
  end_open(rec, 'skipped', 'tampered', why, a.at)
  redis.call('HSET', rec, 'status', 'skipped', 'reason', 'tampered', 'detail', why, 'approval_comment', a.comment)
  done_or_follow(rec, open_z, a.rid, now)
  return {'tampered'}
end
count_backlog(rec, 1, metrics)
redis.call('HSET', rec, 'status', 'dispatched', 'dispatched_ms', now, 'expires_ms', a.expires_ms,
           'approved_by', a.by, 'approved_at', a.at, 'approval_comment', a.comment)
decide_early(rec, a.early, a.at)
if tonumber(a.defer) == 1 then redis.call('HSET', rec, 'conds', '1') end
send(rec, mailbox, a.channel, a.maxlen, a.rid, a.command, a.signature)
redis.call('ZADD', open_z, a.expires_ms, a.rid)
-- A followed record is looked at now (its silence is made, its conditions evaluated, when it dispatches).
if redis.call('HGET', rec, 'follow') == '1' then redis.call('ZADD', open_z, now, a.rid) end
settle(rec, now, open_z, a.rid, metrics)
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
return {'dispatched'}
