-- VERDICT: decide a record's pending outcome, once: effective (the alert resolved) or ineffective.
-- Returns 1 when this call decided it, 0 when it was not pending (decided already, or nothing to decide).
local rec = KEYS[1]          -- the record
local journal_key = KEYS[2]  -- the history journal
-- {status: effective | ineffective, resolved_at (RFC 3339 or ''), time_to_resolve_s (or -1), rid}
local a = cjson.decode(ARGV[1])

local cur = redis.call('HGET', rec, 'outcome')
if not cur then return 0 end
local ok, o = pcall(cjson.decode, cur)
if not ok or type(o) ~= 'table' or o.status ~= 'pending' then return 0 end
o.status = a.status
if a.resolved_at ~= '' then o.resolved_at = a.resolved_at end
if tonumber(a.time_to_resolve_s) >= 0 then o.time_to_resolve_s = tonumber(a.time_to_resolve_s) end
redis.call('HSET', rec, 'outcome', cjson.encode(o))
redis.call('RPUSH', journal_key, 'o|' .. a.rid .. '|pending|' .. a.status)
return 1
