-- MARK: count one more reconciler pass in a hash that only this script writes. Redis logs the writes of a
-- script that writes more than once inside MULTI/EXEC in the AOF, as it logs the scripts that write records,
-- episodes and mailboxes, and may drop all of those when it loads the AOF (an ACL file whose default user may
-- not run them). The reconciler compares this count with the copy it keeps with a plain SET (keys.MARK_SEEN),
-- so such a loss is noticed even though plain writes survived. Two writes, so that it is logged as they are.
-- Returns the new count.
local mark = KEYS[1]            -- the count (keys.MARK: fields n and at)
local at = ARGV[1]              -- now (ms)
local n = redis.call('HINCRBY', mark, 'n', 1)
redis.call('HSET', mark, 'at', at)
return n
