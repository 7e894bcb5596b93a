-- DECIDE_MANY: the DECIDE of several (alert, playbook) pairs in one call, and (on a single Redis) the
-- indexes of the records they made, so a notification costs one round trip (the webhook answers
-- within milliseconds). client/wire/records.py prepends decide.lua as the function decide_one(KEYS, ARGV).
-- On Redis Cluster every key of one call must share a slot: the service makes one call per slot and writes
-- the indexes (their own slots) itself afterwards (index = 0).
-- Pair i's ARGV is DECIDE's ARGV[1] plus `ix`: {label: target label, follow_now: 0/1 (a new followed record is
-- looked at now: it has a silence, a notification or conditions to do), later_ms (when a dispatched or held
-- record is due otherwise), approve_by_s (seconds, the approvals index's score)}
-- Returns one {status, record id, reason, first} per pair, in order ('reach': not decided, nothing written;
-- first: when the reconciler is first due at the pair's target, in ms, or -1 for never).
local spec = cjson.decode(ARGV[1])  -- {n: pairs, index: 0/1 (write the indexes too)}
local n = tonumber(spec.n)
local index = tonumber(spec.index) == 1
-- Pair i's DECIDE KEYS: KEYS[10 * (i - 1) + 1 .. 10 * i] (the 8th is the record again when there is no
-- previous record; the 9th the metrics hash; the 10th the heartbeat).
local function pair_keys(i) return {unpack(KEYS, 10 * (i - 1) + 1, 10 * i)} end
local function pair_args(i) return cjson.decode(ARGV[1 + i]) end  -- pair i's arguments (JSON)
-- With index, after the pairs' keys:
local journal = KEYS[10 * n + 1]     -- the history journal (service/history.py)
local approvals_key = KEYS[10 * n + 2]  -- the approvals index
local due_key = KEYS[10 * n + 3]     -- the due targets
local mailboxes = KEYS[10 * n + 4]   -- the targets with mailboxes

local out = {}
local due = {}
local history, approvals = {}, {}
for i = 1, n do
  local a = pair_args(i)
  local answer = decide_one(pair_keys(i), {a})
  if answer[1] ~= 'reach' then
    local status, rid = answer[1], answer[2]
    local new = rid ~= '' and status ~= 'duplicate' and status ~= 'stale' and status ~= 'closed'
    local held = status == 'pending_approval'
    -- When the reconciler first looks at the target: now for a new followed record that has a silence, a
    -- notification or conditions to do (or nothing dispatched to wait for), and for a resolve; else at the
    -- record's expiry or deadline (an ack brings that forward); never for the rest.
    local first = nil
    if (tonumber(a.follow) == 1 and new and (tonumber(a.ix.follow_now) == 1 or (status ~= 'dispatched' and not held)))
        or (a.mode == 'resolved' and status ~= 'stale') then
      first = tonumber(a.now)
    elseif status == 'dispatched' or held or (tonumber(a.undo) == 1 and status == 'dry_run') then
      first = tonumber(a.ix.later_ms)
    end
    answer[4] = first or -1
    if index then
      -- DECIDE journaled the records it made; an older record it answered with is journaled again, so the
      -- history lists it again (that heals a listing lost to a crash).
      if rid ~= '' and not new then history[#history + 1] = rid end
      if held then
        approvals[#approvals + 1] = a.ix.approve_by_s
        approvals[#approvals + 1] = rid
      end
      if first then
        local label = a.ix.label
        if due[label] == nil or first < due[label] then due[label] = first end
      end
    end
  end
  out[i] = answer
end
if index then
  if #history > 0 then redis.call('RPUSH', journal, unpack(history)) end
  if #approvals > 0 then redis.call('ZADD', approvals_key, unpack(approvals)) end
  -- One ZADD and one SADD for all the call's targets.
  local dz, labels = {}, {}
  for label, first in pairs(due) do
    dz[#dz + 1] = first
    dz[#dz + 1] = label
    labels[#labels + 1] = label
  end
  if #labels > 0 then
    redis.call('ZADD', due_key, 'LT', unpack(dz))
    redis.call('SADD', mailboxes, unpack(labels))
  end
end
return out
