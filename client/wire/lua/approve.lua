-- APPROVE: a person's decision on a record held for approval: release it, or reject it.
-- KEYS[1] record   KEYS[2] mailbox   KEYS[3] episode (may be absent for manual records)   KEYS[4] obligation
-- KEYS[5] open (the target's due items)
-- ARGV[1] JSON {now (ms), at (RFC 3339), verb: approve | reject | tamper, by, comment, maxlen, channel, command,
--   signature, expires_ms, undo (1: the playbook has on_resolved actions), ob_member, ob_due_ms,
--   episode_ttl_ms, rid, early, defer (as in DECIDE)}
-- verb tamper: a person approved, but the hash no longer holds what was decided (its seal does not match):
-- nothing is sent, the record ends skipped / tampered.
-- Returns {'dispatched'}, {'rejected'}, {'tampered'}, {'missing'}, {'not_pending', status} or {'expired'}.
local a = cjson.decode(ARGV[1])
local rec = KEYS[1]
-- KEYS[6] the metrics hash (see common.lua)
metrics_key = KEYS[6]
local now = tonumber(a.now)
if redis.call('EXISTS', rec) == 0 then return {'missing'} end
local st = redis.call('HGET', rec, 'status')
if st ~= 'pending_approval' then return {'not_pending', st} end
hist_touch(rec)  -- every path below changes its status
if now > tonumber(redis.call('HGET', rec, 'approve_by') or '0') then
  end_open(rec, 'expired', 'approval_expired', 'Nobody approved it in time.', a.at)
  redis.call('HSET', rec, 'status', 'expired', 'reason', 'approval_expired')
  done_or_follow(rec, KEYS[5], a.rid, now)
  return {'expired'}
end
-- Either way the record is no longer a hold of its episode.
if KEYS[3] and redis.call('EXISTS', KEYS[3]) == 1 then
  local holds = ' ' .. (redis.call('HGET', KEYS[3], 'holds') or '') .. ' '
  holds = string.gsub(holds, ' ' .. string.gsub(a.rid, '%p', '%%%0') .. ' ', ' ')
  redis.call('HSET', KEYS[3], 'holds', holds)
end
if a.verb == 'reject' then
  end_open(rec, 'skipped', 'rejected', 'A person rejected it.', a.at)
  redis.call('HSET', rec, 'status', 'skipped', 'reason', 'rejected', 'rejected_by', a.by, 'rejected_at', a.at,
             'approval_comment', a.comment)
  done_or_follow(rec, KEYS[5], a.rid, now)
  return {'rejected'}
end
if a.verb == 'tamper' then
  local why = 'Its stored steps no longer match what was decided, so nothing was sent.'
  end_open(rec, 'skipped', 'tampered', why, a.at)
  redis.call('HSET', rec, 'status', 'skipped', 'reason', 'tampered', 'detail', why, 'approval_comment', a.comment)
  done_or_follow(rec, KEYS[5], a.rid, now)
  return {'tampered'}
end
count_backlog(rec, 1)
redis.call('HSET', rec, 'status', 'dispatched', 'dispatched_ms', now, 'expires_ms', a.expires_ms,
           'approved_by', a.by, 'approved_at', a.at, 'approval_comment', a.comment)
decide_early(rec, a.early, a.at)
if tonumber(a.defer) == 1 then redis.call('HSET', rec, 'conds', '1') end
send(rec, KEYS[2], a.channel, a.maxlen, a.rid, a.command, a.signature)
redis.call('ZADD', KEYS[5], a.expires_ms, a.rid)
-- A followed record is looked at now (its silence is made, its conditions evaluated, when it dispatches).
if redis.call('HGET', rec, 'follow') == '1' then redis.call('ZADD', KEYS[5], now, a.rid) end
settle(rec, now, KEYS[5], a.rid)
-- A released firing record changes things the final resolve must undo.
if tonumber(a.undo) == 1 and KEYS[4] then
  if redis.call('EXISTS', KEYS[4]) == 0 then
    redis.call('HSET', KEYS[4], 'rid', a.rid, 'dry', '0', 'seen', now)
  else
    redis.call('HSET', KEYS[4], 'dry', '0')
  end
  redis.call('PEXPIRE', KEYS[4], a.episode_ttl_ms)
  redis.call('ZADD', KEYS[5], a.ob_due_ms, a.ob_member)
end
return {'dispatched'}
