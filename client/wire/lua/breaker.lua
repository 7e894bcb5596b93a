-- BREAKER: a playbook's max_active (README: "The breaker"), in the playbook's own hash slot: which targets have an
-- open remediation of it, so that decisions on every worker and replica never exceed the bound together.
-- DECIDE runs in the target's slot, which on Redis Cluster differs from this one: the service claims here first,
-- decides, and releases the claim of a pair that DECIDE did not dispatch or hold (a duplicate, a cooldown ...).
-- Returns {answer, targets counted}: claim answers 'ok' (claimed), 'open' (refused) or 'opened' (refused, and
-- the breaker was closed until now: one notification); release answers 'released'.
-- A claim costs the same however many are open: the targets are counted in a hash as claims come and go (only
-- the claims that lapsed since the last call are read).
-- the open claims (sorted set: member = the record id of a ladder's first record, score = when the claim
-- lapses if nobody releases it, ms)
local open_z = KEYS[1]
local state = KEYS[2]        -- string: set while the breaker holds remediations back
local counts = KEYS[3]       -- hash: target label -> how many of the open claims are that target's
local a = cjson.decode(ARGV[1])  -- {op: claim | release, now (ms), member, limit (targets), lease_ms}
local op, now, member = a.op, tonumber(a.now), a.member
local limit, lease_ms = tonumber(a.limit), tonumber(a.lease_ms)

-- A record id ends with ~kind~name: its target.
local function target_of(m)
  return string.match(m, '~(.*)$') or ''
end

-- One claim leaves: its target's count goes down, and the target leaves the count at zero.
local function drop(m)
  local t = target_of(m)
  if redis.call('HINCRBY', counts, t, -1) <= 0 then redis.call('HDEL', counts, t) end
end

for _, m in ipairs(redis.call('ZRANGEBYSCORE', open_z, '-inf', now)) do drop(m) end
redis.call('ZREMRANGEBYSCORE', open_z, '-inf', now)
local label = target_of(member)
if op == 'release' then
  if redis.call('ZREM', open_z, member) == 1 then drop(member) end
  local n = redis.call('HLEN', counts)
  if n < limit then redis.call('DEL', state) end
  return {'released', n}
end
local n = redis.call('HLEN', counts)
local has = redis.call('HEXISTS', counts, label) == 1
if has or n < limit then
  if redis.call('ZADD', open_z, now + lease_ms, member) == 1 then redis.call('HINCRBY', counts, label, 1) end
  redis.call('PEXPIRE', open_z, lease_ms)
  redis.call('PEXPIRE', counts, lease_ms)
  if n + (has and 0 or 1) < limit then redis.call('DEL', state) end
  return {'ok', n + (has and 0 or 1)}
end
if redis.call('SET', state, now, 'NX', 'PX', lease_ms) then return {'opened', n} end
return {'open', n}
