#!/usr/bin/env python3
"""What the fleet controller keeps per Node, in process (issue 27: 50,000 realistic GPU nodes in 256 MiB).

The Nodes are the fleet benchmark's realistic ones (bench/_fleet.py: GPU and feature-discovery labels, 50 images,
five conditions, the plugin's annotations rendered by the plugin's own code), built without an API server, given
the fields the server adds (uid, resourceVersion, creationTimestamp) and written once as the controller reads them:
LIST pages of 100 (the controller's) as JSON text (in a temporary file). Each page is parsed and every Node's facts
(plugin/controller/nodes.py ``facts_of``) are kept in a dict by name (``facts``), or the pages are fed to the
controller's own cache (``reconciler``: its entry per Node, the assessment, the sets it counts them in); the page is
let go. Per Node, after all N:

- ``tracemalloc``: the bytes Python still holds (the facts and everything they keep of the parsed JSON);
- ``rss``: the process's RSS growth (a run of its own: tracemalloc's bookkeeping would count). It includes what
  parsing a page leaves in the allocator's pools, the same for any N; ``marginal`` is the RSS that one more Node
  costs, from the smallest and the largest N.

Each measurement runs in a fresh process; the median of ``--repeats``. Variants: every device Healthy, and one of
eight devices Unhealthy (reset-gpu, with a reason) on every tenth Node.

    python bench/bench_controller_memory.py
    python bench/bench_controller_memory.py --nodes 5000 --repeats 1 --variants healthy
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import tracemalloc
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench._common import machine, rss_mib  # noqa: E402
from bench._fleet import Fleet  # noqa: E402
from plugin.controller.nodes import Keys, NodeFacts, facts_of  # noqa: E402
from plugin.controller.policy import Rules  # noqa: E402
from plugin.controller.reconciler import Reconciler, Settings  # noqa: E402
from plugin.kube.client import LIST_PAGE  # noqa: E402
from plugin.kube.names import DEFAULT_PREFIX  # noqa: E402
from tests.fakes.controller_api import FakeControllerApi, FakeLeadership  # noqa: E402

PAGE = LIST_PAGE  # the controller's LIST page size
UNHEALTHY_EVERY = 10  # the unhealthy variant: one device Unhealthy on every tenth Node
VARIANTS = {"healthy": 0, "unhealthy": UNHEALTHY_EVERY}
# What keeps the Nodes: their facts in a dict by name, or the controller's own cache (the reconciler, fed the LIST
# pages as the watcher feeds it; not leading, so it writes nothing).
CACHES = ("facts", "reconciler")


def page_text(fleet: Fleet, names: Sequence[str], first: int, unhealthy_every: int) -> bytes:
    items = []
    for i, name in enumerate(names, first):
        if unhealthy_every and i % unhealthy_every == 0:
            fleet.node_object(name)
            fleet.change_device(name, 3, "Unhealthy", "reset-gpu", "xid-79")
        doc = fleet.node_object(name)
        fleet.forget_node(name)
        doc["metadata"].update(uid=str(uuid.UUID(int=i + 1)), resourceVersion=str(1_000_000 + i),
                               creationTimestamp="2026-01-01T00:00:00Z")
        items.append(doc)
    return json.dumps({"kind": "NodeList", "apiVersion": "v1", "items": items}, separators=(",", ":")).encode()


def write_pages(path: Path, n: int, unhealthy_every: int) -> None:
    """``n`` Nodes (and one page more, for the warm-up) as LIST pages, one JSON document a line."""
    fleet = Fleet(0, REPO, realistic=True, kwok=False, verbose=False)
    with open(path, "wb") as out:
        for first in range(0, n + PAGE, PAGE):
            names = [f"gpu-node-{i:05d}" for i in range(first, first + PAGE)]
            out.write(page_text(fleet, names, first, unhealthy_every) + b"\n")


def child(path: Path, n: int, mode: str, cache: str) -> dict[str, float]:
    keys = Keys(DEFAULT_PREFIX)

    def reconciler() -> Reconciler:
        return Reconciler(FakeControllerApi(), Settings(keys=keys, rules=Rules()), FakeLeadership(leader=False))

    with open(path, "rb") as pages:
        def load(count: int, into: dict[str, NodeFacts] | Reconciler) -> None:
            if isinstance(into, Reconciler):
                into.begin_list()
            for _ in range(0, count, PAGE):
                page = json.loads(pages.readline())
                if isinstance(into, Reconciler):
                    into.list_page(page["items"])
                else:
                    for doc in page["items"]:
                        f = facts_of(doc, keys)
                        into[f.name] = f
                del page
            if isinstance(into, Reconciler):
                into.end_list()

        # One page parsed and dropped first: the allocator's pools and every lazily built table exist before the
        # baseline, so what follows is what the Nodes cost.
        load(PAGE, {} if cache == "facts" else reconciler())
        kept: dict[str, NodeFacts] | Reconciler = {} if cache == "facts" else reconciler()
        if mode == "tracemalloc":
            tracemalloc.start()
        gc.collect()
        before = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else rss_mib() * 1048576
        load(n, kept)
        gc.collect()
        after = tracemalloc.get_traced_memory()[0] if mode == "tracemalloc" else rss_mib() * 1048576
    assert len(kept if isinstance(kept, dict) else kept.entries) == n
    return {"bytes_per_node": (after - before) / n, "rss_mib": rss_mib()}


def measure(path: Path, n: int, mode: str, cache: str, repeats: int) -> dict[str, float]:
    runs = []
    for _ in range(repeats):
        out = subprocess.run([sys.executable, __file__, "--child", str(path), str(n), mode, cache],
                             check=True, capture_output=True, text=True).stdout
        runs.append(json.loads(out))
    per = [r["bytes_per_node"] for r in runs]
    return {"median": round(statistics.median(per)), "min": round(min(per)), "max": round(max(per)),
            "rss_mib_end": round(statistics.median(r["rss_mib"] for r in runs), 1)}


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--nodes", default="5000,20000", help="comma-separated Node counts (default 5000,20000)")
    ap.add_argument("--repeats", type=int, default=3, help="runs per measurement, each a fresh process (median)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--caches", default=",".join(CACHES), help=f"comma-separated: {', '.join(CACHES)}")
    ap.add_argument("--child", nargs=4, metavar=("PAGES", "N", "MODE", "CACHE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(Path(args.child[0]), int(args.child[1]), args.child[2], args.child[3])))
        return 0
    try:
        sizes = [int(x) for x in args.nodes.split(",")]
    except ValueError:
        ap.error(f"--nodes: comma-separated whole numbers, not {args.nodes!r}")
    if not sizes or any(n < PAGE or n % PAGE for n in sizes):
        ap.error(f"--nodes: each a multiple of {PAGE} (the page size), not {args.nodes!r}")
    variants = [v for v in args.variants.split(",") if v]
    if not variants or any(v not in VARIANTS for v in variants):
        ap.error(f"--variants: some of {', '.join(VARIANTS)}, not {args.variants!r}")
    caches = [c for c in args.caches.split(",") if c]
    if not caches or any(c not in CACHES for c in caches):
        ap.error(f"--caches: some of {', '.join(CACHES)}, not {args.caches!r}")
    if args.repeats < 1:
        ap.error("--repeats: must be at least 1")
    results: list[dict[str, Any]] = []
    marginal: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-controller-memory-") as tmp:
        for variant in variants:
            pages = Path(tmp) / f"{variant}.jsonl"
            write_pages(pages, max(sizes), VARIANTS[variant])
            for cache in caches:
                rows = []
                for n in sizes:
                    row = {"nodes": n, "variant": variant, "cache": cache,
                           "tracemalloc_bytes_per_node": measure(pages, n, "tracemalloc", cache, args.repeats),
                           "rss_bytes_per_node": measure(pages, n, "rss", cache, args.repeats)}
                    print(f"{n} nodes, {variant}, {cache}: {row['tracemalloc_bytes_per_node']['median']} B/node "
                          f"(tracemalloc), {row['rss_bytes_per_node']['median']} B/node RSS", file=sys.stderr,
                          flush=True)
                    rows.append(row)
                if len(rows) > 1:
                    # Between the smallest and the largest fleet: what one more Node costs, less what any number
                    # costs (the working set of a page being parsed, the pools it leaves behind).
                    lo, hi = rows[0], rows[-1]
                    marginal.append({"variant": variant, "cache": cache, "nodes": f"{lo['nodes']}..{hi['nodes']}",
                                     "rss_bytes_per_node": round((hi["rss_bytes_per_node"]["rss_mib_end"]
                                                                  - lo["rss_bytes_per_node"]["rss_mib_end"])
                                                                 * 1048576 / (hi["nodes"] - lo["nodes"]))})
                results += rows
            pages.unlink()
    print(json.dumps({"machine": machine(), "page": PAGE, "unhealthy_every": UNHEALTHY_EVERY,
                      "repeats": args.repeats, "results": results,
                      "marginal": marginal}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
