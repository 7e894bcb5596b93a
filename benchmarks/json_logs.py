"""Cost of one JSON log line about a remediation (the webhook writes one per new remediation)."""
from __future__ import annotations

import io
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainmedic.client.logs import JsonFormatter, remediation

N = 50_000


def per_call_us(fn, n: int = N) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(3):  # best of three: the machine is shared
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, time.perf_counter() - t0)
    return best / n * 1e6


def main() -> None:
    log = logging.getLogger("bench.trainmedic.webhook")
    log.propagate = False
    sink = io.StringIO()
    handler = logging.StreamHandler(sink)
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    extra = remediation("01KAB3X7Y8Z9ABCDEFGHJKMNPQ~job~llama-ft-01", "071ff15f8faead0f", "job:llama-ft-01",
                        playbook="loss-spike", alertname="TrainingLossSpike", status="dispatched", reason=None)

    def line() -> None:
        log.info("remediation %s: playbook %s on %s for %s (%s): %s%s", extra["remediation_id"], "loss-spike",
                 "job:llama-ft-01", "TrainingLossSpike", "firing", "dispatched", "", extra=extra)
        sink.seek(0)
        sink.truncate()

    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    plain = per_call_us(line)
    handler.setFormatter(JsonFormatter())
    as_json = per_call_us(line)
    log.setLevel(logging.WARNING)
    off = per_call_us(line)
    print(f"remediation log line, plain text formatter:   {plain:6.2f} us")
    print(f"remediation log line, JSON (service/logs.py): {as_json:6.2f} us")
    print(f"remediation log line, level above INFO:       {off:6.2f} us")


if __name__ == "__main__":
    main()
