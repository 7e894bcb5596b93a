-- RECONCILE: bring one target's open records to the truth: expire what nobody took, offer again what a
-- process that is gone had claimed, end the rest lost, expire holds nobody approved; and say which
-- undo obligations are due.
-- Returns {next due ms or -1, {record id, status}..., obligation members that are due..., records to follow
-- up...} as {next, changed (flat list of id, status), obligations, follow}. A record the reconciler follows
-- (field follow = 1: its outcome, ladder, silence and notifications) is listed in `follow` when it is due;
-- once settled, its due time is the reconciler's to set (service/decide/followup.py).
local open_z = KEYS[1]         -- the target's due items: record id or obligation member -> due ms
local mailbox = KEYS[2]        -- the target's mailbox
local heartbeat = KEYS[3]      -- the target's heartbeat
local metrics = KEYS[4]        -- the metrics hash (common.lua)
-- {now (ms), at (RFC 3339), grace_ms, recheck_ms, maxlen, channel, rec_prefix, limit}
local a = cjson.decode(ARGV[1])
local now, grace, recheck = tonumber(a.now), tonumber(a.grace_ms), tonumber(a.recheck_ms)

-- Every open item of the target, not only those due: a visit may come early (a new process's first
-- heartbeat asks for one), and a claim that process's predecessor left must be offered to it now.
local due = redis.call('ZRANGE', open_z, 0, tonumber(a.limit) - 1)
-- Who is alive: a claim by host:pid[:rank] is orphaned when the target heartbeats from another process.
local live = nil
local hb = redis.call('GET', heartbeat)
if hb then
  local ok, info = pcall(cjson.decode, hb)
  if ok and type(info) == 'table' and info.host and info.pid then live = info.host .. ':' .. tostring(info.pid) end
end
local changed, obligations, follow = {}, {}, {}
for _, member in ipairs(due) do
  local score = tonumber(redis.call('ZSCORE', open_z, member))
  if string.sub(member, 1, 3) == 'ob|' then
    if score <= now then obligations[#obligations + 1] = member end
  else
    local rec = a.rec_prefix .. member
    local st = redis.call('HGET', rec, 'status')
    local nxt = nil
    if st == 'pending_approval' then
      local by = tonumber(redis.call('HGET', rec, 'approve_by') or '0')
      if now > by then
        end_open(rec, 'expired', 'approval_expired', 'Nobody approved it in time.', a.at)
        redis.call('HSET', rec, 'status', 'expired', 'reason', 'approval_expired')
        hist_touch(rec, metrics)
        changed[#changed + 1] = member
        changed[#changed + 1] = 'expired'
        score = now
      else
        nxt = by
      end
    elseif st == 'dispatched' then
      local n = tonumber(redis.call('HGET', rec, 'n') or '0')
      local expires = tonumber(redis.call('HGET', rec, 'expires_ms') or '0')
      local orphaned = false
      for i = 0, n - 1 do
        local p = 'a:' .. i .. ':'
        local ast = redis.call('HGET', rec, p .. 'status')
        if ast == 'pending' then
          if now >= expires then
            redis.call('HSET', rec, p .. 'status', 'expired', p .. 'reason', 'expired', p .. 'acked_at', a.at,
                       p .. 'result', cjson.encode({message = 'Nobody took the command before it expired.'}))
          elseif not nxt or expires < nxt then nxt = expires end
        elseif ast == 'delivered' then
          if now >= expires + grace then
            redis.call('HSET', rec, p .. 'status', 'lost', p .. 'reason', 'lost', p .. 'acked_at', a.at,
                       p .. 'result', cjson.encode({message = 'The process that took it never acknowledged it.'}))
          else
            -- A claim held for a while by a process that no longer heartbeats: offer it to the one that does.
            local by = redis.call('HGET', rec, p .. 'claimed_by') or ''
            local since = tonumber(redis.call('HGET', rec, p .. 'claimed_ms') or '0')
            if live and string.sub(by .. ':', 1, #live + 1) ~= live .. ':' and now < expires
               and now - since >= recheck then
              orphaned = true
            end
            -- Look again when the claim is `recheck` old (a process that started meanwhile gets it then),
            -- or `recheck` from now for a claim that old whose claimant still heartbeats.
            local t = since + recheck
            if t <= now or orphaned then t = now + recheck end
            t = math.min(t, expires + grace)
            if not nxt or t < nxt then nxt = t end
          end
        end
      end
      if orphaned then reoffer(rec, mailbox, a.channel, a.maxlen, member) end
      local status = settle(rec, now, open_z, member, metrics)
      if status ~= 'dispatched' then
        changed[#changed + 1] = member
        changed[#changed + 1] = status
        nxt = nil
        score = now
      end
    end
    local followed = st and redis.call('HGET', rec, 'follow') == '1'
    if followed and score <= now then follow[#follow + 1] = member end
    if nxt then
      redis.call('ZADD', open_z, nxt, member)
    elseif not followed then
      redis.call('ZREM', open_z, member)
    end
  end
end
local first = redis.call('ZRANGE', open_z, 0, 0, 'WITHSCORES')
local next_due = -1
if first[2] then next_due = tonumber(first[2]) end
return {tostring(next_due), changed, obligations, follow}
