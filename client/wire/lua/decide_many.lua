-- DECIDE_MANY: the DECIDE of several (alert, playbook) pairs in one call, and (on a single Redis) the
-- indexes of the records they made, so a notification costs one round trip (the webhook answers within
-- milliseconds). client/wire/scripts.py prepends decide.lua as the function decide_one(KEYS, ARGV, later).
-- On Redis Cluster every key of one call must share a slot: the service makes one call per slot and writes
-- the indexes (their own slots) itself afterwards (index = 0).
-- Returns one {status, record id, reason, first, counted} per pair, in order ('reach': not decided, nothing
-- written; first: when the reconciler is first due at the pair's target, in ms, or -1 for never; counted: 1
-- when the record is its node's incident).
local n = tonumber(ARGV[1])      -- pairs
local index = ARGV[2] == '1'     -- write the indexes too
-- Pair i's DECIDE KEYS: KEYS[11 * (i - 1) + 1 .. 11 * i] (the 6th is the record again when there is no
-- previous record; the 8th its journal, the 9th its metrics hash, the 10th and 11th its node's incidents).
local function pair_keys(i) return {unpack(KEYS, 11 * (i - 1) + 1, 11 * i)} end
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
local approvals_key = KEYS[11 * n + 1]  -- the approvals index (held records by deadline)
local due_key = KEYS[11 * n + 2]        -- the due targets
local nodes_key = KEYS[11 * n + 3]      -- the nodes seen (Lemon nodes)

-- What the pairs share, written once at the end: journal entries by journal, backlog moves by metrics hash and
-- kind, the approvals index's new and ended holds, each target's first due time, the nodes with a new incident.
local later = {journal = {}, backlog = {}, approvals = {}, unheld = {}, due = {}, nodes = {}}
local out = {}
for i, block in ipairs(pair_blocks()) do
  out[i] = decide_one(pair_keys(i), block, later)
end
for key, entries in pairs(later.journal) do
  if #entries > 0 then redis.call('RPUSH', key, unpack(entries)) end
end
for key, kinds in pairs(later.backlog) do
  for kind, delta in pairs(kinds) do redis.call('HINCRBY', key, 'backlog|' .. kind, delta) end
end
if index then
  if #later.approvals > 0 then redis.call('ZADD', approvals_key, unpack(later.approvals)) end
  if #later.unheld > 0 then redis.call('ZREM', approvals_key, unpack(later.unheld)) end
  -- One ZADD for all the call's targets; LT never moves a target's due time later (the reconciler does).
  local dz = {}
  for label, first in pairs(later.due) do
    dz[#dz + 1] = first
    dz[#dz + 1] = label
  end
  if #dz > 0 then redis.call('ZADD', due_key, 'LT', unpack(dz)) end
  local seen = {}
  for node, at in pairs(later.nodes) do
    seen[#seen + 1] = math.floor(at / 1000)
    seen[#seen + 1] = node
  end
  if #seen > 0 then redis.call('ZADD', nodes_key, unpack(seen)) end
end
return out
