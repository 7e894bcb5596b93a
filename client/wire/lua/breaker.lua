-- BREAKER: a playbook's max_active (README: "The breaker"), in the playbook's own hash slot: which targets have an
-- open remediation of it, so that decisions on every worker and replica never exceed the bound together.
-- DECIDE runs in the target's slot, which on Redis Cluster differs from this one: the service claims here first,
-- decides, and releases the claim of a pair that DECIDE did not dispatch or hold (a duplicate, a cooldown ...).
-- A claim is a lease of seconds: the reconciler renews the claims of remediations still open, so a claim whose
-- record was never made (its worker died in between) or whose remediation ended lapses within the lease.
-- Returns {answer, targets counted}: claim answers 'ok' (claimed), 'open' (refused) or 'opened' (refused, and
-- the breaker was closed until now: one notification); release and renew answer 'released' and 'renewed'.
-- A claim costs the same however many are open: the targets are counted in a hash as claims come and go (only
-- the claims that lapsed since the last call are read).
local open_z = KEYS[1]       -- the open claims: member = the record id of a ladder's first record, score = when it lapses (ms)
local state = KEYS[2]        -- string: set while the breaker holds remediations back
local counts = KEYS[3]       -- hash: target label -> how many of the open claims are that target's
local a = cjson.decode(ARGV[1])  -- {op: claim | release | renew, now (ms), members, limit (targets), lease_ms}
local op, now = a.op, tonumber(a.now)
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
if op == 'release' then
  for _, m in ipairs(a.members) do
    if redis.call('ZREM', open_z, m) == 1 then drop(m) end
  end
  local n = redis.call('HLEN', counts)
  if n < limit then redis.call('DEL', state) end
  return {'released', n}
end
if op == 'renew' then
  for _, m in ipairs(a.members) do redis.call('ZADD', open_z, 'XX', now + lease_ms, m) end
  if redis.call('EXISTS', open_z) == 1 then
    redis.call('PEXPIRE', open_z, lease_ms)
    redis.call('PEXPIRE', counts, lease_ms)
  end
  -- Still full: the breaker stays open (one notification per opening); below the bound it has closed.
  local n = redis.call('HLEN', counts)
  if n < limit then redis.call('DEL', state) else redis.call('PEXPIRE', state, lease_ms) end
  return {'renewed', n}
end
local member = a.members[1]
local label = target_of(member)
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
