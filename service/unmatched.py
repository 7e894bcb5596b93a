"""Alerts that no playbook matched: counted by alert name in Redis, and logged once a minute per name."""
from __future__ import annotations

import hashlib
import logging
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..client.wire import keys

log = logging.getLogger("trainmedic.unmatched")

# Distinct alert names counted on their own; every further name is counted as OTHER (a bounded label set).
MAX_NAMES = 100
OTHER = "other"
LOG_EVERY = 60  # seconds between two log lines of one alert name, across every worker and replica

# Counts and log marks for every worker at once: a worker's memory would count its own share, and each worker
# would log the same name.
_NOTE = """
local counts = KEYS[1]
local max_names = tonumber(ARGV[1])
local log_every = tonumber(ARGV[2])
local other = ARGV[3]
-- ARGV[4], ARGV[5]: the first name and how many of its alerts; KEYS[2]: that name's log mark; and so on.
local to_log = {}
for i = 2, #KEYS do
  local name = ARGV[2 * i]
  local n = tonumber(ARGV[2 * i + 1])
  local field = name
  if redis.call('HEXISTS', counts, name) == 0 then
    local names = redis.call('HLEN', counts) - redis.call('HEXISTS', counts, other)
    if names >= max_names then field = other end
  end
  redis.call('HINCRBY', counts, field, n)
  if redis.call('SET', KEYS[i], '1', 'NX', 'EX', log_every) then to_log[#to_log + 1] = name end
end
return to_log
"""


def _digest(name: str) -> str:
    # Alert names are free text of any length; a key names one by a digest.
    return hashlib.sha1(name.encode()).hexdigest()[:16]


def note(r: Any, alertnames: Iterable[str]) -> list[str]:
    """Count alerts no playbook matched, by name; log each name at most once a minute. The names logged now."""
    seen = Counter(alertnames)
    if not seen:
        return []
    names = sorted(seen)
    args: list[Any] = [MAX_NAMES, LOG_EVERY, OTHER]
    for name in names:
        args += [name, seen[name]]
    logged = [str(x) for x in r.register_script(_NOTE)(
        keys=[keys.UNMATCHED, *(keys.unmatched_logged(_digest(n)) for n in names)], args=args)]
    for name in logged:
        log.info("alert %s matched no playbook (%d in this notification; this is logged once a minute per alert "
                 "name, and trainmedic_alerts_unmatched_total counts every one)", name, seen[name])
    return logged


def counts(r: Any) -> dict[str, int]:
    """Alerts no playbook matched so far, by alert name (at most MAX_NAMES names, then OTHER)."""
    return {str(k): int(v) for k, v in r.hgetall(keys.UNMATCHED).items()}
