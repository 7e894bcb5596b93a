"""A Prometheus that remembers alerts: ALERTS series written as OpenMetrics, backfilled into a TSDB with
`promtool tsdb create-blocks-from openmetrics`, and served by Debian's prometheus (for replay's tests and
benchmark)."""
from __future__ import annotations

import subprocess
from pathlib import Path
from collections.abc import Iterable, Mapping

from trainmedic.service.embedded_redis import free_port

from .stack import PROMETHEUS, _Child

PROMTOOL = "/usr/bin/promtool"
# How often the backfilled rule evaluation "ran": one raw sample per series this often while it fired.
EVALUATION = 15.0

Run = tuple[Mapping[str, str], float, float]  # an alert's labels, and when it began and stopped firing


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def write_openmetrics(path: Path, runs: Iterable[Run], every: float = EVALUATION) -> int:
    """ALERTS{alertstate="firing", ...} = 1 every `every` seconds of each run, series by series; the number of
    samples written."""
    by_series: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    for labels, start, end in runs:
        by_series.setdefault(tuple(sorted(labels.items())), []).append((start, end))
    n = 0
    with path.open("w") as f:
        f.write("# HELP ALERTS Alerts that fired.\n# TYPE ALERTS gauge\n")
        for labels, spans in by_series.items():
            name = ",".join(f'{k}="{_escape(v)}"' for k, v in (*labels, ("alertstate", "firing")))
            for start, end in sorted(spans):
                t = start
                while t <= end:
                    f.write(f"ALERTS{{{name}}} 1 {t:.3f}\n")
                    t += every
                    n += 1
        f.write("# EOF\n")
    return n


def backfill(workdir: Path, runs: Iterable[Run], every: float = EVALUATION) -> Path:
    """A TSDB folder holding the runs (promtool's blocks of two hours)."""
    source = workdir / "alerts.om"
    write_openmetrics(source, runs, every)
    data = workdir / "tsdb"
    out = subprocess.run([PROMTOOL, "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                         capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"promtool could not backfill: {out.stderr[-2000:]}")
    return data


class HistoricPrometheus(_Child):
    """Debian's prometheus serving a backfilled TSDB, scraping nothing."""

    def __init__(self, workdir: Path, data: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        conf = workdir / "prometheus.yml"
        conf.write_text("global:\n  scrape_interval: 1m\nscrape_configs: []\n")
        self._spawn([PROMETHEUS, f"--config.file={conf}", f"--storage.tsdb.path={data}",
                     "--storage.tsdb.retention.time=400d", f"--web.listen-address=127.0.0.1:{self.port}"],
                    workdir / "prometheus.log")
        self._wait_ready("/-/ready", 60)
