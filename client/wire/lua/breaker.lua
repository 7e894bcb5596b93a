-- BREAKER: a playbook's max_active (README: "The breaker"), in the playbook's own hash slot: which targets have an
-- open remediation of it, so that decisions on every worker and replica never exceed the bound together.
-- DECIDE runs in the target's slot, which on Redis Cluster differs from this one: the service claims here first,
-- decides, and releases the claim of a pair that DECIDE did not dispatch or hold (a duplicate, a cooldown ...).
-- Returns {answer, targets counted}: claim answers 'ok' (claimed), 'open' (refused) or 'opened' (refused, and
-- the breaker was closed until now: one notification); release answers 'released'.
-- the open claims (sorted set: member = the record id of a ladder's first record, score = when the claim
-- lapses if nobody releases it, ms)
local open_z = KEYS[1]
local state = KEYS[2]        -- string: set while the breaker holds remediations back
local a = cjson.decode(ARGV[1])  -- {op: claim | release, now (ms), member, limit (targets), lease_ms}
local now, limit = tonumber(a.now), tonumber(a.limit)

-- The distinct targets of the open claims (a record id ends with ~kind~name: its target), and whether
-- `label` is among them.
local function targets(label)
  local seen, n, has = {}, 0, false
  for _, m in ipairs(redis.call('ZRANGE', open_z, 0, -1)) do
    local t = string.match(m, '~(.*)$')
    if t and not seen[t] then
      seen[t] = true
      n = n + 1
      if t == label then has = true end
    end
  end
  return n, has
end

redis.call('ZREMRANGEBYSCORE', open_z, '-inf', now)
local label = string.match(a.member, '~(.*)$') or ''
if a.op == 'release' then
  redis.call('ZREM', open_z, a.member)
  local n = targets('')
  if n < limit then redis.call('DEL', state) end
  return {'released', n}
end
local n, has = targets(label)
if has or n < limit then
  redis.call('ZADD', open_z, now + tonumber(a.lease_ms), a.member)
  redis.call('PEXPIRE', open_z, tonumber(a.lease_ms))
  if n + (has and 0 or 1) < limit then redis.call('DEL', state) end
  return {'ok', n + (has and 0 or 1)}
end
if redis.call('SET', state, now, 'NX', 'PX', tonumber(a.lease_ms)) then return {'opened', n} end
return {'open', n}
