-- RELEASE: a process that claimed a command and will not apply it (it is closing) hands it back, so the
-- next process of the target gets it (nothing claimed is dropped at close()).
-- Returns 1 when offered again, 0 when there was nothing to hand back.
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local state = KEYS[3]        -- the target's state (the mailbox's count)
local rid = ARGV[1]          -- the record's id

if redis.call('HGET', rec, 'status') ~= 'dispatched' then return 0 end
if reoffer(rec, mailbox, state, rid) then return 1 end
return 0
