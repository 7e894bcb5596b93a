-- BACKLOG: how many of a target's commands are not yet applied: waiting in the mailbox, or delivered to a
-- process that has not acknowledged them (CONTRACT: trainmedic_mailbox_backlog).
-- KEYS[1] due items (record ids and obligations)
-- ARGV[1] the target's record key prefix
-- Returns the count.
local n = 0
for _, member in ipairs(redis.call('ZRANGE', KEYS[1], 0, -1)) do
  if string.sub(member, 1, 3) ~= 'ob|' and redis.call('HGET', ARGV[1] .. member, 'status') == 'dispatched' then
    n = n + 1
  end
end
return n
