-- RELEASE: a process that claimed a command and will not apply it (it is closing) hands it back, so the
-- next process of the target gets it (nothing claimed is dropped at close()).
-- Returns 1 when offered again, 0 when there was nothing to hand back.
local rec = KEYS[1]          -- the record
local mailbox = KEYS[2]      -- the target's mailbox
local channel = ARGV[1]      -- the target's wake-up channel
local maxlen = ARGV[2]       -- the mailbox's MAXLEN
local rid = ARGV[3]          -- the record's id

if redis.call('EXISTS', rec) == 0 or redis.call('HGET', rec, 'status') ~= 'dispatched' then return 0 end
if reoffer(rec, mailbox, channel, maxlen, rid) then return 1 end
return 0
