-- DEFERRED: a record whose `when:` conditions the reconciler has evaluated: the steps whose condition was
-- false or unknown are skipped, the others go out as one signed command, once.
-- KEYS[1] record   KEYS[2] mailbox   KEYS[3] open (the target's due items)
-- ARGV[1] JSON {now (ms), at, rid, command ('' when no step runs), signature, channel, maxlen,
--   early ({index: [status, reason, message]}: the skipped steps), reason (the record's own, or ''),
--   results ({index: result JSON}: steps the service carried out itself, acked by it)}
-- Returns the record's status, or false when it was not waiting for its conditions (done by another).
local a = cjson.decode(ARGV[1])
local rec = KEYS[1]
-- KEYS[4] the metrics hash (see common.lua)
metrics_key = KEYS[4]
if redis.call('HGET', rec, 'conds') ~= '1' or redis.call('HGET', rec, 'status') ~= 'dispatched' then
  return false
end
redis.call('HDEL', rec, 'conds')
decide_early(rec, a.early, a.at)
for idx, res in pairs(a.results or {}) do
  redis.call('HSET', rec, 'a:' .. idx .. ':result', res, 'a:' .. idx .. ':acked_by', 'service')
end
if a.reason ~= '' then redis.call('HSET', rec, 'reason', a.reason) end
send(rec, KEYS[2], a.channel, a.maxlen, a.rid, a.command, a.signature)
return settle(rec, tonumber(a.now), KEYS[3], a.rid)
