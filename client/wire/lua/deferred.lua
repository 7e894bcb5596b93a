-- DEFERRED: a record whose `when:` conditions the reconciler has evaluated: the steps whose condition was
-- false or unknown are skipped, the others go out as one signed command, once.
-- Returns the record's status, or false when it was not waiting for its conditions (done by another).
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local open_z = KEYS[3]       -- the target's due items
local metrics = KEYS[4]      -- the metrics hash (common.lua)
-- {now (ms), at, rid, command ('' when no step runs), signature, channel, maxlen, early ({index: [status,
--  reason, message]}: the skipped steps), reason (the record's own, or ''), results ({index: result JSON}:
--  steps the service carried out itself, acked by it)}
local a = cjson.decode(ARGV[1])

if redis.call('HGET', rec, 'conds') ~= '1' or redis.call('HGET', rec, 'status') ~= 'dispatched' then
  return false
end
redis.call('HDEL', rec, 'conds')
decide_early(rec, a.early, a.at)
for idx, res in pairs(a.results or {}) do
  redis.call('HSET', rec, 'a:' .. idx .. ':result', res, 'a:' .. idx .. ':acked_by', 'service')
end
if a.reason ~= '' then redis.call('HSET', rec, 'reason', a.reason) end
send(rec, mailbox, a.channel, a.maxlen, a.rid, a.command, a.signature)
return settle(rec, tonumber(a.now), open_z, a.rid, metrics)
