#!/usr/bin/env python3
"""The metrics/probe server under abuse (issue 24, item 13): the plugin as its own process, flooded from loopback.

    python bench/bench_http_abuse.py                         # prints JSON
    python bench/bench_http_abuse.py --connections 200 --seconds 10

One plugin process (8 simulated GPUs, registered with a kubelet stand-in, metrics on a loopback port), then for
``--seconds`` seconds ``--connections`` hostile connections kept open at all times (one is reopened as soon as the
server closes one), as many of each kind; two scenarios, each with a fresh plugin: slow + huge + silent (the flood
the issue names), then the same with hogs added:

- **slow**: a request line, then one header byte every 0.2 s (a slowloris: every gap inside any per-read timeout);
- **huge**: a request line, then 64 KiB header lines as fast as the server takes them, up to ``--huge-mib`` each;
- **silent**: connects and sends nothing;
- **hog**: pipelines a hundred ``/metrics`` requests and never reads an answer.

Meanwhile a scraper opens a fresh connection every ``--scrape-every`` seconds for ``/metrics`` (the worst case for
a scraper: it has to get through the accept queue each time), and the plugin's RSS is sampled every 50 ms.
Prints RSS before, peak during and after, the scrape latency median and max during the flood (and how many
scrapes failed), the connections the flood opened, and whether the process survived. Bounded in count and time,
loopback only. ``--repo`` runs the plugin from another checkout (the code before the fix, for comparison).
The fleet controller runs the same server with the same limits; it needs an API server to start, so it is not here.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._common import machine, rss_mib, simulated_plugin, thread_count  # noqa: E402

# The flood of the issue (slow and huge heads, and silent connections), then the same with pipelining non-readers.
SCENARIOS = {"slow_huge_silent": ("slow", "huge", "silent"), "with_pipelining_hogs": ("slow", "huge", "silent", "hog")}
LINE = b"X-Filler: " + b"y" * (65536 - 12) + b"\r\n"
HOG = b"GET /metrics HTTP/1.1\r\n\r\n" * 100


@dataclass
class Hostile:
    kind: str
    sent: int = 0
    next_at: float = 0.0


@dataclass
class Flood:
    """The attacker: one thread, non-blocking sockets, so a few hundred connections cost it little CPU."""

    port: int
    connections: int
    huge_bytes: int
    kinds: tuple[str, ...]
    opened: int = 0
    refused: int = 0
    conns: dict[socket.socket, Hostile] = field(default_factory=dict)

    def open_one(self, kind: str) -> None:
        sock = socket.socket()
        sock.setblocking(False)
        try:
            sock.connect(("127.0.0.1", self.port))
        except BlockingIOError:
            pass
        except OSError:
            self.refused += 1
            sock.close()
            return
        self.opened += 1
        self.conns[sock] = Hostile(kind)

    def step(self, sock: socket.socket, h: Hostile, now: float, scratch: bytearray) -> None:
        """Push one connection along; raises OSError once the server has closed it."""
        if h.kind != "silent" and h.sent == 0:
            h.sent = sock.send(b"GET /metrics HTTP/1.1\r\n")
        if h.kind == "slow" and now >= h.next_at:
            h.sent += sock.send(b"x")
            h.next_at = now + 0.2
        elif h.kind == "huge" and h.sent < self.huge_bytes:
            h.sent += sock.send(LINE)
        elif h.kind == "hog" and now >= h.next_at:  # more unread answers; the send fails once it is cut
            h.sent += sock.send(HOG)
            h.next_at = now + 0.5
        if h.kind != "hog" and sock.recv_into(scratch) == 0:  # an answer (431, 408) then the close, or a close
            raise ConnectionResetError

    def run(self, until: float) -> None:
        for i in range(self.connections):
            self.open_one(self.kinds[i % len(self.kinds)])
        scratch = bytearray(65536)
        while time.monotonic() < until:
            now = time.monotonic()
            for sock, h in list(self.conns.items()):
                try:
                    self.step(sock, h, now, scratch)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:  # closed by the server: another takes its place
                    del self.conns[sock]
                    sock.close()
                    self.open_one(h.kind)
            # A short pause: an attacker on the same cores as the plugin, not a CPU benchmark of its own.
            time.sleep(0.01)
        for sock in self.conns:
            sock.close()


def scrape(port: int) -> float | None:
    """Seconds for one /metrics on a fresh connection; None when it failed."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
    except OSError:
        return None
    if not data.startswith(b"HTTP/1.1 200 ") or b"gpu_health_device_state" not in data:
        return None
    return time.perf_counter() - t0


def run(repo: Path, kinds: tuple[str, ...], connections: int, seconds: float, huge_mib: float,
        scrape_every: float) -> dict[str, object]:
    with simulated_plugin(repo) as (proc, port):
        for _ in range(20):  # warm: the first scrapes import and size what they need
            scrape(port)
        time.sleep(2.0)
        before, threads_before = rss_mib(proc.pid), thread_count(proc.pid)
        peak, peak_threads = before, threads_before
        flood = Flood(port, connections, int(huge_mib * 1024 * 1024), kinds)
        until = time.monotonic() + seconds
        attacker = threading.Thread(target=flood.run, args=(until,), daemon=True)
        attacker.start()
        latencies: list[float] = []
        failed = 0
        next_scrape = time.monotonic() + 0.5  # let the flood fill every slot first
        while time.monotonic() < until and proc.poll() is None:
            try:
                peak = max(peak, rss_mib(proc.pid))
                peak_threads = max(peak_threads, thread_count(proc.pid))
            except (FileNotFoundError, ProcessLookupError):
                break
            if time.monotonic() >= next_scrape:
                took = scrape(port)
                if took is None:
                    failed += 1
                else:
                    latencies.append(took)
                next_scrape = time.monotonic() + scrape_every
            time.sleep(0.05)
        attacker.join(30)
        survived = proc.poll() is None
        after = final = None
        if survived:
            time.sleep(1.0)
            after = round(rss_mib(proc.pid), 1)
            final_s = scrape(port)
            final = None if final_s is None else round(final_s * 1000, 1)
        ms = [v * 1000 for v in latencies]
        return {
            "kinds": list(kinds), "connections": connections, "seconds": seconds,
            "huge_mib_per_connection": huge_mib,
            "flood_connections_opened": flood.opened, "flood_connects_refused": flood.refused,
            "rss_mib": {"before": round(before, 1), "peak": round(peak, 1), "after": after,
                        "growth_peak": round(peak - before, 1)},
            "threads": {"before": threads_before, "peak": peak_threads},
            "scrape_during_flood": {"n": len(ms), "failed": failed,
                                    "median_ms": round(statistics.median(ms), 1) if ms else None,
                                    "max_ms": round(max(ms), 1) if ms else None},
            "scrape_after_flood_ms": final,
            "survived": survived, "exit_code": proc.returncode,
        }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connections", type=int, default=200, help="hostile connections kept open (default 200)")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long the flood lasts (default 10)")
    ap.add_argument("--huge-mib", type=float, default=6.0, help="header bytes each huge connection sends at most")
    ap.add_argument("--scrape-every", type=float, default=0.2, help="seconds between scrapes during the flood")
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout to run the plugin from (default: this one)")
    args = ap.parse_args()
    out: dict[str, object] = {"machine": machine(),
                              "command": "python bench/bench_http_abuse.py " + " ".join(sys.argv[1:])}
    for name, kinds in SCENARIOS.items():
        out[name] = run(args.repo.resolve(), kinds, args.connections, args.seconds, args.huge_mib, args.scrape_every)
    print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
