-- DEFERRED: a record whose `when:` conditions (or checkpoints) the reconciler has seen to: the steps whose
-- condition was false or unknown are skipped, the others go out as one signed command, once.
-- Returns the record's status, or false when it was not waiting for its conditions (done by another).
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local open_z = KEYS[3]       -- the target's due items
local state = KEYS[4]        -- the target's state (the mailbox's count)
local journal_key = KEYS[5]  -- the history journal
local metrics = KEYS[6]      -- the metrics hash
-- {now (ms), at, rid, signature ('' when no step runs), send, exp (when the command expires, ms), early ({index:
--  [status, reason, message]}: the skipped steps), reason (the record's own, or ''), results ({index: answer
--  JSON}: steps the service carried out itself, acked by it), kind}
local a = cjson.decode(ARGV[1])
local ctx = {journal = journal_key, metrics = metrics, kind = a.kind}

local h = redis.call('HMGET', rec, 'conds', 'status', 'as')
if h[1] ~= '1' or h[2] ~= 'dispatched' then return false end
redis.call('HDEL', rec, 'conds')
local w = {}
local as = decide_early(h[3] or '', a.early, a.at, w)
for idx, answer in pairs(a.results or {}) do
  local i = tonumber(idx)
  if i and i >= 0 and i < #as and string.sub(as, i + 1, i + 1) ~= 'P' then
    w[#w + 1] = 'r:' .. i
    w[#w + 1] = answer
  end
end
w[#w + 1] = 'as'
w[#w + 1] = as
if a.reason ~= '' then w[#w + 1] = 'reason'; w[#w + 1] = a.reason end
if a.signature ~= '' then
  w[#w + 1] = 'sig'; w[#w + 1] = a.signature; w[#w + 1] = 'exp'; w[#w + 1] = a.exp; w[#w + 1] = 'at'
  w[#w + 1] = a.now
  if a.send ~= '' then w[#w + 1] = 'send'; w[#w + 1] = a.send end
end
redis.call('HSET', rec, unpack(w))
if a.signature ~= '' then deliver(mailbox, state, a.rid) end
return settle(rec, tonumber(a.now), open_z, a.rid, ctx)
