-- TAKE: hand the service what a target's own scripts left for it, and empty it: the target's history journal
-- (record changes the history index has not seen) and its counts (acks, their latency, the backlog's moves,
-- refused commands). The service checks each entry and field, and folds them into the keys every target
-- shares (service/fold.py). Returns {journal entries, counts as field, value, ...}.
local journal = KEYS[1]      -- the target's history journal
local metrics = KEYS[2]      -- the target's metrics hash
local limit = tonumber(ARGV[1])  -- journal entries taken at most

local entries = {}
local ok, got = pcall(redis.call, 'LRANGE', journal, 0, limit - 1)
if ok then
  entries = got
  if #entries > 0 then redis.call('LTRIM', journal, #entries, -1) end
else
  redis.call('DEL', journal)  -- not a list: whoever wrote it, nothing of it can be taken
end
local counts = {}
ok, got = pcall(redis.call, 'HGETALL', metrics)
if ok then counts = got end
redis.call('DEL', metrics)
return {entries, counts}
