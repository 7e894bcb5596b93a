-- VERDICT: decide a record's pending outcome, once: effective (the alert resolved) or ineffective.
-- KEYS[1] record
-- ARGV[1] JSON {status: effective | ineffective, resolved_at (RFC 3339 or ''), time_to_resolve_s (or -1)}
-- Returns 1 when this call decided it, 0 when it was not pending (decided already, or nothing to decide).
-- KEYS[2] the metrics hash (see common.lua: it says where the history journal is)
metrics_key = KEYS[2]
local a = cjson.decode(ARGV[1])
local cur = redis.call('HGET', KEYS[1], 'outcome')
if not cur then return 0 end
local o = cjson.decode(cur)
if o.status ~= 'pending' then return 0 end
o.status = a.status
if a.resolved_at ~= '' then o.resolved_at = a.resolved_at end
if tonumber(a.time_to_resolve_s) >= 0 then o.time_to_resolve_s = tonumber(a.time_to_resolve_s) end
redis.call('HSET', KEYS[1], 'outcome', cjson.encode(o))
hist_touch(KEYS[1])
return 1
