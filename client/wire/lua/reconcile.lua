-- RECONCILE: bring one target's open records to the truth: expire what nobody took (its mailbox entry goes
-- too), offer again what a process that is gone had claimed, end the rest lost, expire holds nobody approved;
-- and say which undo obligations are due.
-- Returns {next due ms or -1, {record id, status}..., obligation members that are due..., records to follow
-- up...} as {next, changed (flat list of id, status), obligations, follow}. A record the reconciler follows
-- (field f = 1: its outcome, ladder, silence and notifications) is listed in `follow` when it is due;
-- once settled, its due time is the reconciler's to set (service/decide/followup.py).
local open_z = KEYS[1]         -- the target's due items: record id, obligation member, or `mb` -> due ms
local mailbox = KEYS[2]        -- the target's mailbox
local heartbeat = KEYS[3]      -- the target's heartbeat
local state = KEYS[4]          -- the target's state (q: the mailbox's waiting entries)
local journal_key = KEYS[5]    -- the history journal
local metrics = KEYS[6]        -- the metrics hash
-- {now (ms), at (RFC 3339), grace_ms, recheck_ms, rec_prefix, suffix (what follows an id's head: ~kind~name),
--  limit, kind, keep_ms (how long the mailbox and due items outlive this visit)}
local a = cjson.decode(ARGV[1])
local now, grace, recheck = tonumber(a.now), tonumber(a.grace_ms), tonumber(a.recheck_ms)
local ctx = {journal = journal_key, metrics = metrics, kind = a.kind}

local changed, obligations, follow = {}, {}, {}
local function ended(rid, status)
  changed[#changed + 1] = rid
  changed[#changed + 1] = status
end

-- The mailbox's entries are the commands nobody claimed yet (a claim takes its entry and every older one):
-- those whose record expired, or ended otherwise, leave it; the earliest expiry of the rest is the `mb` item.
local first_expiry = nil
local dropped = {}
for _, entry in ipairs(redis.call('XRANGE', mailbox, '-', '+', 'COUNT', tonumber(a.limit))) do
  local eid, f = entry[1], entry[2]
  local r = nil
  for j = 1, #f - 1, 2 do if f[j] == 'r' then r = f[j + 1] end end
  local rid = r and (#r == 26 and r .. a.suffix or r)
  local h = rid and redis.call('HMGET', a.rec_prefix .. rid, 'status', 'exp', 'as') or {}
  if h[1] ~= 'dispatched' or not string.find(h[3] or '', 'P') then
    dropped[#dropped + 1] = eid
  elseif now >= tonumber(h[2] or '0') then
    local rec = a.rec_prefix .. rid
    end_open(rec, 'E', 'expired', 'Nobody took the command before it expired.', a.at)
    local status = settle(rec, now, open_z, rid, ctx)
    if status ~= 'dispatched' then ended(rid, status) end
    dropped[#dropped + 1] = eid
  elseif not first_expiry or tonumber(h[2]) < first_expiry then
    first_expiry = tonumber(h[2])
  end
end
if #dropped > 0 then redis.call('XDEL', mailbox, unpack(dropped)) end
if first_expiry then redis.call('ZADD', open_z, first_expiry, 'mb') else redis.call('ZREM', open_z, 'mb') end

-- Every open item of the target, not only those due: a visit may come early (a new process's first
-- heartbeat asks for one), and a claim that process's predecessor left must be offered to it now.
local due = redis.call('ZRANGE', open_z, 0, tonumber(a.limit) - 1, 'WITHSCORES')
-- Who is alive: a claim by host:pid[:rank] is orphaned when the target heartbeats from another process.
local live = nil
local hb = redis.call('GET', heartbeat)
if hb then
  local ok, info = pcall(cjson.decode, hb)
  if ok and type(info) == 'table' and info.host and info.pid then live = tostring(info.host) .. ':' .. tostring(info.pid) end
end
for k = 1, #due, 2 do
  local member, score = due[k], tonumber(due[k + 1])
  if string.sub(member, 1, 3) == 'ob|' then
    if score <= now then obligations[#obligations + 1] = member end
  elseif member ~= 'mb' then
    local rec = a.rec_prefix .. member
    local h = redis.call('HMGET', rec, 'status', 'ab', 'exp', 'as', 'c', 'f')
    local st = h[1]
    local nxt = nil
    if st == 'pending_approval' then
      local by = tonumber(h[2] or '0')
      if now > by then
        end_open(rec, 'E', 'approval_expired', 'Nobody approved it in time.', a.at)
        redis.call('HSET', rec, 'status', 'expired', 'reason', 'approval_expired')
        journal(ctx, 'c', member, 'pending_approval', 'expired')
        ended(member, 'expired')
        score = now
      else
        nxt = by
      end
    elseif st == 'dispatched' then
      local expires = tonumber(h[3] or '0')
      local as = h[4] or ''
      local orphaned = false
      local w = {}
      for i = 0, #as - 1 do
        local code = string.sub(as, i + 1, i + 1)
        if code == 'P' then
          if now >= expires then
            as = set_code(as, i, 'E')
            w[#w + 1] = 'r:' .. i
            w[#w + 1] = cjson.encode({reason = 'expired', result = {message = 'Nobody took the command before it expired.'}, at = a.at})
          elseif not nxt or expires < nxt then nxt = expires end
        elseif code == 'D' then
          if now >= expires + grace then
            as = set_code(as, i, 'L')
            w[#w + 1] = 'r:' .. i
            w[#w + 1] = cjson.encode({reason = 'lost', result = {message = 'The process that took it never acknowledged it.'}, at = a.at})
          else
            -- A claim held for a while by a process that no longer heartbeats: offer it to the one that does.
            local by, since = string.match(h[5] or '', '^(.*)|(%d+)$')
            since = tonumber(since or '0')
            by = by or ''
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
      if #w > 0 then
        w[#w + 1] = 'as'
        w[#w + 1] = as
        redis.call('HSET', rec, unpack(w))
      end
      if orphaned then reoffer(rec, mailbox, state, member) end
      local status = settle(rec, now, open_z, member, ctx)
      if status ~= 'dispatched' then
        ended(member, status)
        nxt = nil
        score = now
      end
    end
    local followed = st and h[6] == '1'
    if followed and score <= now then follow[#follow + 1] = member end
    if nxt and followed and score > now then
      -- A visit before a followed record is due: the time its follow-up asked for stands, if sooner.
      redis.call('ZADD', open_z, 'LT', nxt, member)
    elseif nxt then
      redis.call('ZADD', open_z, nxt, member)
    elseif not followed then
      redis.call('ZREM', open_z, member)
    end
  end
end
-- The mailbox's count, made true again (a crash, or someone writing the target's keys, may have moved it).
if redis.call('EXISTS', state) == 1 then redis.call('HSET', state, 'q', redis.call('XLEN', mailbox)) end
for _, key in ipairs({mailbox, open_z}) do
  if redis.call('EXISTS', key) == 1 then redis.call('PEXPIRE', key, a.keep_ms) end
end
local first = redis.call('ZRANGE', open_z, 0, 0, 'WITHSCORES')
local next_due = -1
if first[2] then next_due = tonumber(first[2]) end
return {tostring(next_due), changed, obligations, follow}
