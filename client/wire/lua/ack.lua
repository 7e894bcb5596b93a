-- ACK: write one action's answer into its record, count it, and settle the record's status.
-- Returns {action status, record status}, or false for no record. A final status is never overwritten,
-- except `lost`: an ack that arrives after all is the truth.
local rec = KEYS[1]          -- the record
local ledger = KEYS[2]       -- the job's ledger of sticky LR changes (remembered for resumes)
local open_z = KEYS[3]       -- the target's due items
local journal_key = KEYS[4]  -- the target's history journal
local metrics = KEYS[5]      -- the target's metrics hash: ack counts and latency, folded in by the service
-- {index, status, answer (JSON text: reason, result, at, by), acked_at, acked_by, now (ms), replayed (0/1),
--  ledger (1: an applied scale_lr/set_lr to remember for resumes), ledger_max, keep_ms, rid, action, latency
--  (seconds from dispatch, or -1), slot (its latency bucket), kind, up (the target's channel to the service)}
local a = cjson.decode(ARGV[1])
local ctx = {journal = journal_key, metrics = metrics, kind = a.kind, up = a.up}

local h = redis.call('HMGET', rec, 'status', 'as')
if not h[1] then return false end
local now = tonumber(a.now)
local i = tonumber(a.index)
local as = h[2] or ''
if not i or i < 0 or i >= #as then return {'missing', h[1]} end
local cur = string.sub(as, i + 1, i + 1)
if cur ~= 'P' and cur ~= 'D' and cur ~= 'L' then return {NAME[cur] or cur, h[1]} end
local code = CODE[a.status] or 'F'
-- The answer as the applier wrote it (JSON: reason, result, at, by), kept byte for byte.
redis.call('HSET', rec, 'as', set_code(as, i, code), 'r:' .. i, a.answer, 'acked', '1')
if cur == 'L' then redis.call('HSET', rec, 'late:' .. i, '1') end
if cur == 'L' and h[1] == 'lost' then
  redis.call('HSET', rec, 'status', 'dispatched')
  journal(ctx, 'c', a.rid, 'lost', 'dispatched')
  count_backlog(ctx, 1)
end
-- Counted in the target's own metrics hash; the service folds it into what GET /metrics shows.
local action = a.action
redis.call('HINCRBY', metrics, 'n|' .. action .. '|' .. a.status, 1)
if tonumber(a.latency) >= 0 then
  redis.call('HINCRBY', metrics, 'b|' .. action .. '|' .. a.slot, 1)
  redis.call('HINCRBYFLOAT', metrics, 's|' .. action, a.latency)
end
if tonumber(a.ledger) == 1 and a.status == 'applied' and tonumber(a.replayed) ~= 1 then
  -- The record keeps its signature (ls), so a resumed client that verifies can check the entry against it
  -- (nothing else stops whoever may write the job's keys from appending one).
  redis.call('RPUSH', ledger, cjson.encode({rid = a.rid, index = i, at = a.acked_at, by = a.acked_by}))
  redis.call('LTRIM', ledger, -tonumber(a.ledger_max), -1)
  redis.call('PEXPIRE', ledger, a.keep_ms)
  redis.call('HSET', rec, 'ls', '1')
end
local status = settle(rec, now, open_z, a.rid, ctx)
-- Counts to fold, and a record that settled has an outcome to follow: the service looks at the target now.
tell(ctx, 'acks')
return {a.status, status}
