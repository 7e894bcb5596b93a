"""Lua scripts that touch a record together with its target's mailbox keys (all in one hash slot)."""
from __future__ import annotations

# Recompute a record's status from its actions (CONTRACT: applied / partially_applied / failed), plus
# expired when every action expired and skipped when every action had nothing to do (a dry-run agent,
# empty_cache without CUDA): neither is a failure. Left unchanged while any action is pending or delivered.
RECORD_STATUS = r"""
local function settle(rec)
  local n = tonumber(redis.call('HGET', rec, 'n') or '0')
  local applied, expired, skipped, open = 0, 0, 0, 0
  for i = 0, n - 1 do
    local st = redis.call('HGET', rec, 'a:' .. i .. ':status')
    if st == 'applied' then applied = applied + 1
    elseif st == 'expired' then expired = expired + 1
    elseif st == 'skipped' then skipped = skipped + 1
    elseif st == 'pending' or st == 'delivered' then open = open + 1 end
  end
  if open > 0 or n == 0 then return redis.call('HGET', rec, 'status') end
  local status = 'failed'
  if applied == n then status = 'applied'
  elseif applied > 0 then status = 'partially_applied'
  elseif expired == n then status = 'expired'
  elseif skipped == n then status = 'skipped' end
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

# Upper bounds (seconds) of the dispatch-to-ack latency histogram kept in each target's ack stats hash.
ACK_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0)
ACK_STATS_TTL_MS = 30 * 86400 * 1000  # refreshed by every ack


def _lua_buckets() -> str:
    return "{" + ", ".join(repr(b) for b in ACK_LATENCY_BUCKETS) + "}"


# KEYS[1] record, KEYS[2] the target's ack stats (optional: the same slot);
# ARGV index, status, result json, acked_at, acked_by, now_ms, stats ttl ms (optional).
# Writes one action's ack unless it already has a final status; returns {status, latency ms or -1,
# record status}. Each first ack also counts in the stats hash ("n|ACTION|STATUS"), and its latency in
# the bucket "b|ACTION|I" (I: index of the first bound it fits, or "inf"), "s|ACTION" (sum of seconds):
# acks are written by trainers and agents, never by the service, so /metrics reads them from here.
ACK = RECORD_STATUS + r"""
local BUCKETS = """ + _lua_buckets() + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local p = 'a:' .. ARGV[1] .. ':'
local st = redis.call('HGET', KEYS[1], p .. 'status')
if st ~= 'pending' and st ~= 'delivered' then return {st, '', redis.call('HGET', KEYS[1], 'status')} end
redis.call('HSET', KEYS[1], p .. 'status', ARGV[2], p .. 'result', ARGV[3], p .. 'acked_at', ARGV[4],
           p .. 'acked_by', ARGV[5])
local sent = redis.call('HGET', KEYS[1], 'dispatched_ms') or ''
local latency = -1
-- Clocks of service and trainer may disagree by a little: never a negative latency.
if sent ~= '' then latency = math.max(0, tonumber(ARGV[6]) - tonumber(sent)) end
if KEYS[2] then
  local action = string.match(redis.call('HGET', KEYS[1], p .. 'spec') or '', '"action":%s*"([^"]*)"') or 'unknown'
  redis.call('HINCRBY', KEYS[2], 'n|' .. action .. '|' .. ARGV[2], 1)
  if latency >= 0 then
    local seconds, slot = latency / 1000, 'inf'
    for i, le in ipairs(BUCKETS) do
      if seconds <= le then slot = tostring(i - 1); break end
    end
    redis.call('HINCRBY', KEYS[2], 'b|' .. action .. '|' .. slot, 1)
    redis.call('HINCRBYFLOAT', KEYS[2], 's|' .. action, seconds)
  end
  redis.call('PEXPIRE', KEYS[2], tonumber(ARGV[7] or '""" + str(ACK_STATS_TTL_MS) + r"""'))
end
return {ARGV[2], tostring(latency), settle(KEYS[1])}
"""
