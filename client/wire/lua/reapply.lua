-- REAPPLY: note on an action that a resumed or rolled-back job applied it again (sticky LR changes, README:
-- the training client). Returns the number of reapplied entries, or false for no record.
local rec = KEYS[1]                  -- the record
local index = ARGV[1]                -- the action's index
local entry = cjson.decode(ARGV[2])  -- {at, step, by}
local keep = tonumber(ARGV[3])       -- most entries kept

if redis.call('EXISTS', rec) == 0 then return false end
local f = 're:' .. index
local list = cjson.decode(redis.call('HGET', rec, f) or '[]')
list[#list + 1] = entry
while #list > keep do table.remove(list, 1) end
redis.call('HSET', rec, f, cjson.encode(list))
return #list
