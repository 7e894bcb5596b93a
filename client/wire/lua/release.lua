-- RELEASE: a process that claimed a command and will not apply it (it is closing) hands it back, so the
-- next process of the target gets it (nothing claimed is dropped at close()).
-- KEYS[1] record   KEYS[2] mailbox
-- ARGV[1] channel   ARGV[2] mailbox maxlen   ARGV[3] record id
-- Returns 1 when offered again, 0 when there was nothing to hand back.
if redis.call('EXISTS', KEYS[1]) == 0 or redis.call('HGET', KEYS[1], 'status') ~= 'dispatched' then return 0 end
if reoffer(KEYS[1], KEYS[2], ARGV[1], ARGV[2], ARGV[3]) then return 1 end
return 0
