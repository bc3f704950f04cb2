"""What NVML has shown on this node across restarts: the NVLink links each GPU has had up, and the NVML calls that
took the process down with them.

Both live in one small file in the state dir (``nvml.json``), apart from the health state file: they are facts about
the node's driver library, not about any device's health, and the backend below the health engine keeps them.

- A link seen active and now down is a fault; a link slot never active is topology. Remembering what was up means a
  plugin restarted after a link failed still knows the link belongs there.
- A call that crashed the process would crash it again at every start: a node that loses all its GPUs to a crash
  loop. The first call of each signal on each GPU model is bracketed by a marker file written before it and removed
  after it; a marker found at start names the call that never returned, and that signal is skipped on that model
  and driver from then on (a driver upgrade tries it again).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from plugin.atomicfile import write_atomic

log = logging.getLogger(__name__)

FILE = "nvml.json"
INFLIGHT = "nvml-inflight.json"


def crash_key(signal: str, model: str, driver: str) -> str:
    return f"{signal}|{model}|{driver}"


class NvmlMemory:
    """Thread-safe; with no directory it remembers for this process only (tests, `inspect`)."""

    def __init__(self, directory: Path | None, read_only: bool = False) -> None:
        """``read_only``: learn from the directory, never write it (``inspect`` beside a running plugin)."""
        self._dir = directory
        self._read_only = read_only
        self._lock = threading.Lock()
        self._links: dict[str, set[int]] = {}
        self._crashed: dict[str, dict[str, Any]] = {}
        self.found_crash: dict[str, Any] | None = None  # the marker this start found, if any
        if directory is not None:
            self._load(directory)

    def _load(self, directory: Path) -> None:
        path = directory / FILE
        try:
            doc = json.loads(path.read_text())
            links = doc.get("links_seen_active", {})
            crashed = doc.get("crashed_calls", {})
            if not isinstance(links, dict) or not isinstance(crashed, dict):
                raise ValueError("links_seen_active and crashed_calls must be objects")
            self._links = {str(u): {int(x) for x in v} for u, v in links.items()}
            self._crashed = {str(k): dict(v) for k, v in crashed.items()}
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError, AttributeError) as exc:
            # Losing this file costs the memory of links that were up, never the plugin: start without it.
            log.error("%s unreadable (%s): starting without the NVLink links seen before or crashed calls", path,
                      exc)
        marker = directory / INFLIGHT
        if self._read_only:
            return  # the marker may be the running plugin's own, in flight now
        try:
            found = json.loads(marker.read_text())
        except FileNotFoundError:
            return
        except (OSError, ValueError) as exc:
            log.error("%s unreadable (%s): removed", marker, exc)
            marker.unlink(missing_ok=True)
            return
        if isinstance(found, dict) and {"signal", "model", "driver"} <= set(found):
            key = crash_key(str(found["signal"]), str(found["model"]), str(found["driver"]))
            self._crashed[key] = {"signal": found["signal"], "model": found["model"], "driver": found["driver"],
                                  "call": found.get("call", ""), "at": found.get("at", 0)}
            self.found_crash = dict(found)
            log.error("the last run died inside libnvidia-ml reading %s (%s) on %s, driver %s: that signal is "
                      "skipped on this GPU model and driver from now on (delete %s to try it again)",
                      found["signal"], found.get("call", "?"), found["model"], found["driver"], directory / FILE)
            self._save()
        marker.unlink(missing_ok=True)

    def _save(self) -> None:
        if self._dir is None or self._read_only:
            return
        doc = {"links_seen_active": {u: sorted(v) for u, v in sorted(self._links.items())},
               "crashed_calls": self._crashed}
        try:
            write_atomic(self._dir / FILE, json.dumps(doc, indent=1).encode() + b"\n")
        except OSError as exc:
            log.error("cannot write %s: %s", self._dir / FILE, exc)

    # NVLink -----------------------------------------------------------------------------------------------------

    def links_seen(self, uuid: str) -> frozenset[int]:
        with self._lock:
            return frozenset(self._links.get(uuid, ()))

    def saw_active(self, uuid: str, links: Iterable[int]) -> None:
        """Remember links seen up; written only when the set grows (at discovery, or when a link first trains)."""
        with self._lock:
            known = self._links.setdefault(uuid, set())
            new = set(links) - known
            if not new:
                return
            known |= new
            self._save()

    # Crashed calls ----------------------------------------------------------------------------------------------

    def crashed(self, signal: str, model: str, driver: str) -> dict[str, Any] | None:
        with self._lock:
            return self._crashed.get(crash_key(signal, model, driver))

    def crashed_calls(self) -> list[dict[str, Any]]:
        with self._lock:
            return [dict(v) for v in self._crashed.values()]

    @contextmanager
    def inflight(self, signal: str, model: str, driver: str, call: str) -> Iterator[None]:
        """Bracket a call that has not yet returned once on this model in this process with a marker on disk."""
        if self._dir is None or self._read_only:
            yield
            return
        marker = self._dir / INFLIGHT
        doc = {"signal": signal, "model": model, "driver": driver, "call": call, "at": time.time(),
               "pid": os.getpid()}
        try:
            write_atomic(marker, json.dumps(doc).encode())
        except OSError as exc:
            log.warning("cannot write %s (%s): a crash in %s would not be remembered", marker, exc, call)
        try:
            yield
        finally:
            marker.unlink(missing_ok=True)
