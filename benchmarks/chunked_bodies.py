"""Requests built to starve the service's workers: bodies of one-byte chunks, and connections holding almost
1 MiB each; what they cost the probes and the workers' memory.

Run: .venv/bin/python benchmarks/chunked_bodies.py [--chunks 50000] [--attackers 8] [--connections 400]

Against the service under gunicorn (2 workers of 4 threads, as `trainmedic serve` runs it), in one run:
- the chunked attack: `--attackers` concurrent unauthenticated POST /login, each a form of `--chunks` bytes
  sent as one-byte chunks (about 300 KB on the wire for 50,000), sent whole at once; meanwhile GET /healthz
  one after another, 100 ms apart, each timed. The same logins with a Content-Length body beside it, as the
  reference;
- the memory case: `--connections` connections, each sending the headers of a POST /webhook with a body of
  1,048,000 bytes and all of it but the last 1,000 bytes, then waiting; the workers' resident memory before,
  at its highest while the connections hold their bodies (the kernel's high-water mark), and what the
  connections were answered (TRAINMEDIC_REQUEST_DEADLINE is 60 s here, so none is closed for slowness).
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from common import TOKEN, Stack, percentile  # noqa: E402

BODY = 1_048_000  # just under 1 MiB
HELD = BODY - 1_000  # what each connection of the memory case sends of it


def head(path: str, *lines: str) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n" + "".join(f"{line}\r\n" for line in lines)
            + "\r\n").encode()


def login(chunks: int, chunked: bool) -> bytes:
    """An unauthenticated login form of `chunks` bytes: one-byte chunks, or a Content-Length body."""
    form = b"token=x&pad=" + b"a" * (chunks - 12)
    kind = "Content-Type: application/x-www-form-urlencoded"
    if not chunked:
        return head("/login", kind, f"Content-Length: {len(form)}") + form
    return head("/login", kind, "Transfer-Encoding: chunked") + b"".join(
        b"1\r\n" + form[i:i + 1] + b"\r\n" for i in range(len(form))) + b"0\r\n\r\n"


def status_of(sock: socket.socket) -> int:
    """The status of the answer on sock (0 if the connection closed without one)."""
    got = b""
    while b"\r\n" not in got:
        data = sock.recv(65536)
        if not data:
            return 0
        got += data
    return int(got.split(b" ", 2)[1])


def attack(url: str, port: int, request: bytes, attackers: int) -> dict[str, Any]:
    """`attackers` copies of request at once, /healthz probed until all are answered."""
    took: list[float] = []
    statuses: list[int] = []

    def one() -> None:
        t0 = time.monotonic()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=600) as sock:
                sock.sendall(request)
                statuses.append(status_of(sock))
        except OSError:
            statuses.append(0)
        took.append(time.monotonic() - t0)

    threads = [threading.Thread(target=one, daemon=True) for _ in range(attackers)]
    for t in threads:
        t.start()
    probes: list[float] = []
    failed = 0
    host, _, probe_port = url.removeprefix("http://").partition(":")
    while any(t.is_alive() for t in threads) or len(probes) + failed < 5:
        t0 = time.monotonic()
        try:
            with socket.create_connection((host, int(probe_port)), timeout=60) as sock:
                sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
                if status_of(sock) != 200:
                    raise OSError("not 200")
            probes.append(time.monotonic() - t0)
        except OSError:
            failed += 1
        time.sleep(0.1)
    for t in threads:
        t.join()
    return {"seconds_min": min(took), "seconds_median": statistics.median(took), "seconds_max": max(took),
            "statuses": sorted(set(statuses)), "probes": len(probes), "probes_failed": failed,
            "healthz_p50_ms": percentile(probes, 50) * 1000 if probes else None,
            "healthz_p99_ms": percentile(probes, 99) * 1000 if probes else None,
            "healthz_max_ms": max(probes) * 1000 if probes else None}


def workers_of(master: int) -> list[int]:
    children = Path(f"/proc/{master}/task/{master}/children").read_text().split()
    return [int(c) for c in children]


def memory_mb(pid: int, field: str) -> float:
    """VmRSS (resident now) or VmHWM (its highest yet) of pid, in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def hold(port: int, master: int, connections: int) -> dict[str, Any]:
    """`connections` connections each holding HELD bytes of a BODY-byte webhook; the workers' memory."""
    workers = workers_of(master)
    before = [memory_mb(w, "VmRSS") for w in workers]
    request = head("/webhook", f"Authorization: Bearer {TOKEN}", "Content-Type: application/json",
                   f"Content-Length: {BODY}") + b" " * HELD
    socks, refused_early = [], 0
    t0 = time.monotonic()
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        try:
            sock.sendall(request)
        except OSError:  # answered and closed while it was still sending
            refused_early += 1
        socks.append(sock)
    sent_s = time.monotonic() - t0
    time.sleep(2)  # the workers read what is still in the sockets' buffers
    during = [memory_mb(w, "VmRSS") for w in workers]
    peak = [memory_mb(w, "VmHWM") for w in workers]
    answers: dict[str, int] = {}
    for sock in socks:
        sock.settimeout(0.05)
        try:
            data = sock.recv(65536)
            status = data.split(b" ", 2)[1].decode() if data else "closed"
        except TimeoutError:
            status = "held"
        except OSError:
            status = "reset"
        answers[status] = answers.get(status, 0) + 1
        sock.close()
    return {"workers": len(workers), "rss_before_mb": before, "rss_during_mb": during, "rss_peak_mb": peak,
            "send_seconds": sent_s, "answers": answers, "refused_while_sending": refused_early}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=50_000, help="one-byte chunks in each login")
    ap.add_argument("--attackers", type=int, default=8, help="concurrent chunked logins")
    ap.add_argument("--connections", type=int, default=400, help="connections holding almost 1 MiB")
    args = ap.parse_args()

    with Stack(workers=2) as stack:
        attack(stack.url, stack.port, login(1000, chunked=False), 8)  # warm-up: templates, sessions
        cl = attack(stack.url, stack.port, login(args.chunks, chunked=False), args.attackers)
        ch = attack(stack.url, stack.port, login(args.chunks, chunked=True), args.attackers)
    with Stack(workers=2, env={"TRAINMEDIC_REQUEST_DEADLINE": "60"}) as stack:
        time.sleep(1)
        mem = hold(stack.port, stack.proc.pid, args.connections)

    print(f"{args.attackers} concurrent unauthenticated POST /login of {args.chunks:,} bytes, 2 workers x 4 threads; "
          "GET /healthz one at a time, 100 ms apart, while they are served")
    print(f"{'body':<28} {'request s (min/median/max)':>28} {'statuses':>9} {'probes':>7} {'failed':>7} "
          f"{'healthz p50 ms':>15} {'p99 ms':>8} {'max ms':>8}")
    for name, row in ((f"{args.chunks:,} one-byte chunks", ch), ("Content-Length", cl)):
        spread = f"{row['seconds_min']:.2f} / {row['seconds_median']:.2f} / {row['seconds_max']:.2f}"
        p50, p99, top = (f"{row[k]:.0f}" if row[k] is not None else "-"
                         for k in ("healthz_p50_ms", "healthz_p99_ms", "healthz_max_ms"))
        print(f"{name:<28} {spread:>28} {','.join(map(str, row['statuses'])):>9} {row['probes']:>7} "
              f"{row['probes_failed']:>7} {p50:>15} {p99:>8} {top:>8}")
    print()
    print(f"{args.connections} connections each holding {HELD:,} bytes of a {BODY:,}-byte POST /webhook "
          f"(sent in {mem['send_seconds']:.1f} s), {mem['workers']} workers")
    rss = " / ".join(f"{b:.0f} -> {d:.0f} (peak {p:.0f})" for b, d, p in
                     zip(mem["rss_before_mb"], mem["rss_during_mb"], mem["rss_peak_mb"]))
    print(f"workers' RSS MB, before -> while held: {rss}")
    print(f"answers: {', '.join(f'{k}: {v}' for k, v in sorted(mem['answers'].items()))}"
          f" (held: no answer yet; {mem['refused_while_sending']} were answered and closed while still sending)")
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    (out / "chunked_bodies.json").write_text(json.dumps({"chunked": ch, "content_length": cl, "memory": mem},
                                                        indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
