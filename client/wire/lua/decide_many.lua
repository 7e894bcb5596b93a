-- DECIDE_MANY: the DECIDE of several (alert, playbook) pairs in one call, and (on a single Redis) the
-- indexes of the records they made, so a notification costs one round trip (the webhook answers
-- within milliseconds). client/wire/records.py prepends decide.lua as the function decide_one(KEYS, ARGV, later).
-- On Redis Cluster every key of one call must share a slot: the service makes one call per slot and writes
-- the indexes (their own slots) itself afterwards (index = 0).
-- Returns one {status, record id, reason, first} per pair, in order ('reach': not decided, nothing written;
-- first: when the reconciler is first due at the pair's target, in ms, or -1 for never).
local n = tonumber(ARGV[1])      -- pairs
local index = ARGV[2] == '1'     -- write the indexes too
-- Pair i's DECIDE KEYS: KEYS[8 * (i - 1) + 1 .. 8 * i] (the 6th is the record again when there is no
-- previous record; the 7th the metrics hash; the 8th the heartbeat).
local function pair_keys(i) return {unpack(KEYS, 8 * (i - 1) + 1, 8 * i)} end
-- The pairs' DECIDE ARGV: after n and index, each pair's block, its length first.
local function pair_blocks()
  local out, p = {}, 3
  for i = 1, n do
    local len = tonumber(ARGV[p])             -- the block's length
    out[i] = {unpack(ARGV, p + 1, p + len)}   -- pair i's block
    p = p + len + 1
  end
  return out
end
-- With index, after the pairs' keys:
local journal = KEYS[8 * n + 1]     -- the history journal (service/history.py)
local approvals_key = KEYS[8 * n + 2]  -- the approvals index
local due_key = KEYS[8 * n + 3]     -- the due targets

-- What the pairs share (common.lua later_flush), and their index entries (decide.lua answer).
local later = {journal = {}, backlog = {}, expire = {}, history = {}, approvals = {}, due = {}}
local out = {}
for i, block in ipairs(pair_blocks()) do
  out[i] = decide_one(pair_keys(i), block, later)
end
later_flush(later)
if index then
  if #later.history > 0 then redis.call('RPUSH', journal, unpack(later.history)) end
  if #later.approvals > 0 then redis.call('ZADD', approvals_key, unpack(later.approvals)) end
  -- One ZADD for all the call's targets. (The set of targets with mailboxes is a cluster's: there the
  -- metrics are per target. The service writes it, with the indexes, after the call.)
  local dz = {}
  for label, first in pairs(later.due) do
    dz[#dz + 1] = first
    dz[#dz + 1] = label
  end
  if #dz > 0 then redis.call('ZADD', due_key, 'LT', unpack(dz)) end
end
return out
