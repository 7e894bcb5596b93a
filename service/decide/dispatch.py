"""Guard, record, then dispatch: one Lua script per (alert, playbook) on the target's hash slot."""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Iterable

import redis

from trainmedic.client.wire import keys
from trainmedic.client.wire.protocol import ActionCall, Command, rfc3339
from trainmedic.client.wire.redis import run_scripts
from trainmedic.client.wire.records import RECORD_STATUS

from trainmedic.service.rules.alerts import Alert, AlertGroup
from trainmedic.service.rules.playbooks import Playbook, Step
from trainmedic.service.rules.targets import Resolution, resolve

# KEYS: 1 episode, 2 cooldown, 3 budget, 4 record, 5 mailbox
# ARGV: 1 now_ms, 2 mode (firing|resolved|manual), 3 episode start, 4 record id, 5 episode ttl ms,
#       6 cooldown ms, 7 budget count, 8 budget window ms, 9 approval, 10 dry run, 11 forced reason,
#       12 record ttl ms, 13 mailbox maxlen, 14 wake channel, 15 command json, 16 approve-by (epoch s),
#       17 number of actions, 18.. record field/value pairs
# Returns {status, record id, reason}; status "duplicate", "no_episode" or "closed" means no new record.
DECIDE = r"""
local now, mode, rid, n = tonumber(ARGV[1]), ARGV[2], ARGV[4], tonumber(ARGV[17])
local dry = ARGV[10]
if mode == 'firing' then
  local ep = redis.call('GET', KEYS[1])
  if ep then
    local start, old = string.match(ep, '^([^|]*)|([^|]*)|')
    if ARGV[3] <= start then
      -- A resend of the same episode (repeat_interval, group change, retry, HA peer): nothing new.
      redis.call('PEXPIRE', KEYS[1], ARGV[5])
      return {'duplicate', old, ''}
    end
  end
elseif mode == 'resolved' then
  local ep = redis.call('GET', KEYS[1])
  if not ep then return {'no_episode', '', ''} end
  redis.call('DEL', KEYS[1])
  local held, decided = string.match(ep, '^[^|]*|([^|]*)|([^|]*)$')
  if decided == 'pending_approval' then
    -- Never approved and now over: cancel the hold, so a late approve cannot throttle a GPU that
    -- nothing will restore, and undo nothing. The held record shares this target's slot (and prefix).
    local rec = string.sub(KEYS[4], 1, #KEYS[4] - #rid) .. held
    if redis.call('HGET', rec, 'status') == 'pending_approval' then
      local m = tonumber(redis.call('HGET', rec, 'n') or '0')
      for i = 0, m - 1 do redis.call('HSET', rec, 'a:' .. i .. ':status', 'expired') end
      redis.call('HSET', rec, 'status', 'expired', 'reason', 'resolved_before_approval')
    end
    return {'closed', '', ''}
  end
  if n == 0 or not (decided == 'dispatched' or decided == 'dry_run') then
    return {'closed', '', ''}
  end
  if decided == 'dry_run' then dry = '1' end
end
local status, reason = 'dispatched', ''
local cooldown, count, window = tonumber(ARGV[6]), tonumber(ARGV[7]), tonumber(ARGV[8])
if ARGV[11] ~= '' then
  status, reason = 'skipped', ARGV[11]
elseif n == 0 then
  status, reason = 'skipped', 'no_actions'
elseif mode ~= 'resolved' then
  -- on_resolved is exempt from guards: it undoes what the firing actions did.
  if cooldown > 0 and redis.call('EXISTS', KEYS[2]) == 1 then
    status, reason = 'skipped', 'cooldown'
  elseif count > 0 then
    redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', now - window)
    if redis.call('ZCARD', KEYS[3]) >= count then status, reason = 'skipped', 'budget_exhausted' end
  end
  if status == 'dispatched' and dry ~= '1' then
    if cooldown > 0 then redis.call('SET', KEYS[2], rid, 'PX', cooldown) end
    if count > 0 then
      redis.call('ZADD', KEYS[3], now, rid)
      redis.call('PEXPIRE', KEYS[3], window)
    end
  end
  if status == 'dispatched' and ARGV[9] == '1' then status = 'pending_approval' end
end
if status ~= 'skipped' and dry == '1' then status = 'dry_run' end
if mode == 'firing' then
  redis.call('SET', KEYS[1], ARGV[3] .. '|' .. rid .. '|' .. status, 'PX', ARGV[5])
end
local fields = {}
for i = 18, #ARGV do fields[#fields + 1] = ARGV[i] end
redis.call('HSET', KEYS[4], 'status', status, 'reason', reason, unpack(fields))
local astatus = 'skipped'
if status == 'dispatched' or status == 'pending_approval' then astatus = 'pending' end
for i = 0, n - 1 do redis.call('HSET', KEYS[4], 'a:' .. i .. ':status', astatus) end
if status == 'dispatched' then
  redis.call('HSET', KEYS[4], 'dispatched_ms', now)
  redis.call('XADD', KEYS[5], 'MAXLEN', '~', ARGV[13], '*', 'c', ARGV[15])
  redis.call('PUBLISH', ARGV[14], rid)
elseif status == 'pending_approval' then
  redis.call('HSET', KEYS[4], 'approve_by', ARGV[16])
end
redis.call('PEXPIRE', KEYS[4], ARGV[12])
return {status, rid, reason}
"""

# KEYS: 1 record, 2 mailbox, 3 episode (optional: firing records only)
# ARGV: 1 now_ms, 2 maxlen, 3 channel, 4 command json, 5 expire only (1/0)
# Releases a record held for approval, or marks it expired once its approval time has passed.
# A release marks the episode dispatched, so its resolve runs on_resolved (an unapproved one does not).
APPROVE = RECORD_STATUS + r"""
if redis.call('EXISTS', KEYS[1]) == 0 then return {'missing'} end
local st = redis.call('HGET', KEYS[1], 'status')
if st ~= 'pending_approval' then return {'not_pending', st} end
local now = tonumber(ARGV[1])
local by = tonumber(redis.call('HGET', KEYS[1], 'approve_by') or '0')
if now / 1000 > by then
  local n = tonumber(redis.call('HGET', KEYS[1], 'n') or '0')
  for i = 0, n - 1 do redis.call('HSET', KEYS[1], 'a:' .. i .. ':status', 'expired') end
  redis.call('HSET', KEYS[1], 'status', 'expired', 'reason', 'approval_expired')
  return {'expired'}
end
if ARGV[5] == '1' then return {'pending'} end
local rid = redis.call('HGET', KEYS[1], 'id')
redis.call('HSET', KEYS[1], 'status', 'dispatched', 'dispatched_ms', now)
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'c', ARGV[4])
redis.call('PUBLISH', ARGV[3], rid)
if KEYS[3] then
  local ep = redis.call('GET', KEYS[3])
  local start, held = string.match(ep or '', '^([^|]*)|([^|]*)|')
  if held == rid then redis.call('SET', KEYS[3], start .. '|' .. rid .. '|dispatched', 'KEEPTTL') end
end
return {'dispatched'}
"""

_CROCKFORD = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"


_last_us = 0


def new_record_id(target: keys.Target) -> str:
    """A time-sortable id (microseconds, then randomness) that also names its target, so its keys can be found."""
    global _last_us
    # Strictly increasing within a process, so records of one notification list in order.
    us = max(time.time_ns() // 1000, _last_us + 1)
    _last_us = us
    n = (us << 75) | int.from_bytes(os.urandom(10), "big") >> 5
    ulid = "".join(_CROCKFORD[(n >> s) & 31] for s in range(125, -5, -5))
    return f"{ulid}~{target.kind}~{target.name}"


@dataclass(frozen=True)
class Settings:
    """Service-wide knobs for deciding and recording."""

    dry_run: bool = False
    episode_ttl: float = 2 * 86400.0  # refreshed by every resend, so a long episode stays one episode
    record_ttl: float = 30 * 86400.0
    history_max: int = 100_000
    mailbox_maxlen: int = 1000


@dataclass(frozen=True)
class Decision:
    """One (alert, playbook) pair to decide on, with the target already resolved."""

    playbook: Playbook
    mode: str  # firing | resolved | manual
    alert: Alert
    resolution: Resolution

    @property
    def steps(self) -> tuple[Step, ...]:
        return self.playbook.on_resolved if self.mode == "resolved" else self.playbook.actions

    @property
    def target(self) -> keys.Target:
        # Records of unusable labels are kept under an empty-named target of the playbook's kind.
        return self.resolution.target or keys.Target(self.playbook.target, "")


@dataclass(frozen=True)
class Outcome:
    """What became of one decision."""

    status: str
    record_id: str | None
    playbook: str
    fingerprint: str
    reason: str | None = None

    @property
    def new(self) -> bool:
        """A record was made (not a resend of a handled episode, not a resolve with nothing to undo)."""
        return bool(self.record_id) and self.status != "duplicate"

    def as_dict(self) -> dict:
        return {"id": self.record_id, "playbook": self.playbook, "fingerprint": self.fingerprint,
                "status": self.status, "reason": self.reason}


def plan(group: AlertGroup, playbooks: Iterable[Playbook]) -> list[Decision]:
    """Every (alert, matching playbook) pair; each alert is matched on its own labels."""
    playbooks = list(playbooks)
    out = []
    for alert in group.alerts:
        for pb in playbooks:
            if pb.matches(alert.labels):
                out.append(Decision(pb, alert.status, alert, resolve(pb.target, alert.labels)))
    return out


class Dispatcher:
    """Runs decisions against Redis: two round trips for a whole notification."""

    def __init__(self, r: redis.Redis, settings: Settings):
        self.r = r
        self.settings = settings
        self._decide = r.register_script(DECIDE)
        self._approve = r.register_script(APPROVE)

    def execute(self, decisions: list[Decision]) -> list[Outcome]:
        """Decide, record and dispatch each decision atomically, then index the new records."""
        if not decisions:
            return []
        now = time.time()
        answers = run_scripts(self.r, [self._decide_call(d, now) for d in decisions])
        outcomes = [Outcome(status=a[0], record_id=a[1] or None, playbook=d.playbook.name,
                            fingerprint=d.alert.fingerprint, reason=a[2] or None)
                    for d, a in zip(decisions, answers)]
        self._index(outcomes, [now + d.playbook.approval_timeout for d in decisions])
        return outcomes

    def _decide_call(self, d: Decision, now: float) -> tuple[Any, list, list]:
        pb, s, target = d.playbook, self.settings, d.target
        rid = new_record_id(target)
        steps = d.steps
        cmd = command_for(rid, target, steps, d.resolution.context, now, pb.expire_after, d.alert.fingerprint)
        budget_count, budget_window = pb.max_runs or (0, 0.0)
        fields: list[Any] = [
            "id", rid, "created_at", rfc3339(now), "playbook", pb.name, "n", len(steps),
            "alert", json.dumps(d.alert.as_dict()), "target", json.dumps(target.as_dict()),
            "mode", d.mode, "detail", d.resolution.detail or "",
            "context", json.dumps(d.resolution.context), "expire_after", pb.expire_after,
        ]
        for i, st in enumerate(steps):
            fields += [f"a:{i}:spec", json.dumps({"action": st.action, "params": dict(st.params)})]
        args = [int(now * 1000), d.mode, d.alert.episode_start, rid, int(s.episode_ttl * 1000),
                int(pb.cooldown * 1000), budget_count, int(budget_window * 1000),
                int(pb.approval), int(pb.dry_run or s.dry_run), d.resolution.reason or "",
                int(s.record_ttl * 1000), s.mailbox_maxlen, keys.wake_channel(target), cmd.to_json(),
                now + pb.approval_timeout, len(steps), *fields]
        ks = [keys.episode(target, pb.name, d.alert.fingerprint), keys.cooldown(target, pb.name),
              keys.budget(target, pb.name), keys.record(rid), keys.mailbox(target)]
        return self._decide, ks, args

    def _index(self, outcomes: list[Outcome], deadlines: list[float]) -> None:
        # The history index lives in its own slot, so it is written after the records. A duplicate
        # re-adds its record (idempotent): that heals an index write lost to a crash in between.
        ids = [o.record_id for o in outcomes if o.record_id]
        if not ids:
            return
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(keys.HISTORY, {i: 0 for i in ids})
        pipe.zremrangebyrank(keys.HISTORY, 0, -self.settings.history_max - 1)
        pending = {o.record_id: deadline for o, deadline in zip(outcomes, deadlines)
                   if o.status == "pending_approval"}
        if pending:
            pipe.zadd(keys.APPROVALS, pending)
        sent = {keys.target_of_record(o.record_id).label for o in outcomes
                if o.status in ("dispatched", "pending_approval")}
        if sent:  # /metrics reads these targets' backlog, also of targets no trainer listens for
            pipe.sadd(keys.MAILBOXES, *sent)
        pipe.execute()

    def approve(self, record_id: str, expire_only: bool = False) -> list:
        """Release a record held for approval (or, with expire_only, expire it when its time is up)."""
        target = keys.target_of_record(record_id)
        h = self.r.hgetall(keys.record(record_id))
        if not h:
            return ["missing"]
        steps = [json.loads(h[f"a:{i}:spec"]) for i in range(int(h.get("n") or 0))]
        now = time.time()
        cmd = command_for(record_id, target, [_AsStep(st["action"], st["params"]) for st in steps],
                          json.loads(h.get("context") or "{}"), now, float(h.get("expire_after") or 3600),
                          json.loads(h.get("alert") or "{}").get("fingerprint", ""))
        ks = [keys.record(record_id), keys.mailbox(target)]
        if h.get("mode") == "firing":
            alert = json.loads(h.get("alert") or "{}")
            ks.append(keys.episode(target, h.get("playbook", ""), alert.get("fingerprint", "")))
        answer = self._approve(keys=ks,
                               args=[int(now * 1000), self.settings.mailbox_maxlen,
                                     keys.wake_channel(target), cmd.to_json(), int(expire_only)])
        if answer[0] != "pending":
            self.r.zrem(keys.APPROVALS, record_id)
        return answer

    def expire_approvals(self) -> None:
        """Mark records whose approval time has passed as expired (cheap when there are none)."""
        for rid in self.r.zrangebyscore(keys.APPROVALS, "-inf", time.time() - 1):
            self.approve(rid, expire_only=True)


@dataclass(frozen=True)
class _AsStep:
    action: str
    params: dict


def command_for(record_id: str, target: keys.Target, steps: Iterable[Any], context: dict, now: float,
                expire_after: float, fingerprint: str = "") -> Command:
    """The mailbox command for a record's actions."""
    calls = tuple(ActionCall(i, st.action, dict(st.params)) for i, st in enumerate(steps))
    return Command(record_id=record_id, kind=target.kind, target=target.name, actions=calls,
                   issued_at=now, expires_at=now + expire_after, context=context, fingerprint=fingerprint)
