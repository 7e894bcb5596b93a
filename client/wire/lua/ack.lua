-- ACK: write one action's outcome into its record, count it, and settle the record's status.
-- Returns {action status, dispatch-to-ack latency in ms or -1, record status}, or false for no record.
-- A final status is never overwritten, except `lost`: an ack that arrives after all is the truth.
local rec = KEYS[1]          -- the record
local stats_key = KEYS[2]    -- the target's ack stats
local ledger = KEYS[3]       -- the job's ledger of sticky LR changes (remembered for resumes)
local open_z = KEYS[4]       -- the target's due items
local metrics = KEYS[5]      -- the metrics hash (common.lua): counts and latency summed over every target
-- {index, status, reason, result (JSON text), acked_at, acked_by, now (ms), replayed (0/1), stats_ttl_ms,
--  ledger (1: an applied scale_lr/set_lr to remember for resumes), ledger_max, rid, buckets}
local a = cjson.decode(ARGV[1])

if redis.call('EXISTS', rec) == 0 then return false end
local now = tonumber(a.now)
local p = 'a:' .. a.index .. ':'
local st = redis.call('HGET', rec, p .. 'status')
if st ~= 'pending' and st ~= 'delivered' and st ~= 'lost' then
  return {st, '-1', redis.call('HGET', rec, 'status')}
end
redis.call('HSET', rec, p .. 'status', a.status, p .. 'reason', a.reason, p .. 'result', a.result,
           p .. 'acked_at', a.acked_at, p .. 'acked_by', a.acked_by)
if st == 'lost' then
  redis.call('HSET', rec, p .. 'late', '1')
  if redis.call('HGET', rec, 'status') == 'lost' then
    redis.call('HSET', rec, 'status', 'dispatched')
    hist_touch(rec, metrics)
    count_backlog(rec, 1, metrics)
  end
end
local sent = tonumber(redis.call('HGET', rec, 'dispatched_ms') or '')
local latency = -1
-- Clocks of the service and the applier may disagree a little: never a negative latency.
if sent then latency = math.max(0, now - sent) end
local spec = cjson.decode(redis.call('HGET', rec, p .. 'spec') or '{}')
local action = spec.action or 'unknown'
-- The target's own stats, and the same counts in the metrics hash (summed over every target).
local stats = {stats_key}
if metrics ~= stats_key then stats[2] = metrics end
for _, key in ipairs(stats) do
  redis.call('HINCRBY', key, 'n|' .. action .. '|' .. a.status, 1)
  if latency >= 0 then
    local seconds, slot = latency / 1000, 'inf'
    for i, le in ipairs(a.buckets) do
      if seconds <= le then slot = tostring(i - 1); break end
    end
    redis.call('HINCRBY', key, 'b|' .. action .. '|' .. slot, 1)
    redis.call('HINCRBYFLOAT', key, 's|' .. action, seconds)
  end
  redis.call('PEXPIRE', key, a.stats_ttl_ms)
end
if tonumber(a.ledger) == 1 and a.status == 'applied' and tonumber(a.replayed) ~= 1 then
  -- With the signed command it came in, so a resumed client that verifies can check the entry (nothing else
  -- stops whoever may write the job's keys from appending one).
  redis.call('RPUSH', ledger, cjson.encode({rid = a.rid, index = tonumber(a.index), action = action,
                                             params = spec.params, at = a.acked_at, by = a.acked_by,
                                             cmd = redis.call('HGET', rec, 'cmd') or '',
                                             sig = redis.call('HGET', rec, 'sig') or ''}))
  redis.call('LTRIM', ledger, -tonumber(a.ledger_max), -1)
  redis.call('PEXPIRE', ledger, a.stats_ttl_ms)
end
local status = settle(rec, now, open_z, a.rid, metrics)
return {a.status, tostring(latency), status}
