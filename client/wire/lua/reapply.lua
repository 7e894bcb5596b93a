-- REAPPLY: note on an action that a resumed or rolled-back job applied it again (sticky LR changes, README: the training client).
-- KEYS[1] record
-- ARGV[1] action index   ARGV[2] JSON {at, step, by}   ARGV[3] most entries kept
-- Returns the number of reapplied entries, or false for no record.
if redis.call('EXISTS', KEYS[1]) == 0 then return false end
local f = 'a:' .. ARGV[1] .. ':reapplied'
local list = cjson.decode(redis.call('HGET', KEYS[1], f) or '[]')
list[#list + 1] = cjson.decode(ARGV[2])
while #list > tonumber(ARGV[3]) do table.remove(list, 1) end
redis.call('HSET', KEYS[1], f, cjson.encode(list))
return #list
