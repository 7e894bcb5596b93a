"""Lua scripts that touch a record together with its target's mailbox keys (all in one hash slot)."""
from __future__ import annotations

# Recompute a record's status from its actions (CONTRACT: applied / partially_applied / failed).
# Left unchanged while any action is still pending or delivered.
RECORD_STATUS = r"""
local function settle(rec)
  local n = tonumber(redis.call('HGET', rec, 'n') or '0')
  local applied, expired, open = 0, 0, 0
  for i = 0, n - 1 do
    local st = redis.call('HGET', rec, 'a:' .. i .. ':status')
    if st == 'applied' then applied = applied + 1
    elseif st == 'expired' then expired = expired + 1
    elseif st == 'pending' or st == 'delivered' then open = open + 1 end
  end
  if open > 0 or n == 0 then return redis.call('HGET', rec, 'status') end
  local status = 'failed'
  if applied == n then status = 'applied'
  elseif applied > 0 then status = 'partially_applied'
  elseif expired == n then status = 'expired' end
  redis.call('HSET', rec, 'status', status)
  return status
end
"""

# KEYS[1] cursor, KEYS[2] record (optional); ARGV[1] stream entry id.
# Moves the target's cursor past the entry and marks its actions delivered; 0 if already claimed.
CLAIM = r"""
local function older(a, b)
  local am, as = string.match(a, '^(%d+)-(%d+)$')
  local bm, bs = string.match(b, '^(%d+)-(%d+)$')
  am, as, bm, bs = tonumber(am), tonumber(as), tonumber(bm), tonumber(bs)
  return am < bm or (am == bm and as <= bs)
end
local cur = redis.call('GET', KEYS[1]) or '0-0'
if older(ARGV[1], cur) then return 0 end
redis.call('SET', KEYS[1], ARGV[1])
if KEYS[2] and redis.call('EXISTS', KEYS[2]) == 1 then
  local n = tonumber(redis.call('HGET', KEYS[2], 'n') or '0')
  for i = 0, n - 1 do
    local f = 'a:' .. i .. ':status'
    if redis.call('HGET', KEYS[2], f) == 'pending' then redis.call('HSET', KEYS[2], f, 'delivered') end
  end
end
return 1
"""

# KEYS[1] record; ARGV index, status, result json, acked_at, acked_by, now_ms.
# Writes one action's ack unless it already has a final status; returns the record status.
ACK = RECORD_STATUS + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local p = 'a:' .. ARGV[1] .. ':'
local st = redis.call('HGET', KEYS[1], p .. 'status')
if st ~= 'pending' and st ~= 'delivered' then return {st, '', redis.call('HGET', KEYS[1], 'status')} end
redis.call('HSET', KEYS[1], p .. 'status', ARGV[2], p .. 'result', ARGV[3], p .. 'acked_at', ARGV[4],
           p .. 'acked_by', ARGV[5])
local sent = redis.call('HGET', KEYS[1], 'dispatched_ms') or ''
return {ARGV[2], tostring(sent == '' and -1 or (tonumber(ARGV[6]) - tonumber(sent))), settle(KEYS[1])}
"""
