"""Durable health state in the state dir: what must survive a restart (latched faults, the transition history).

One JSON file, written whole and renamed into place; a background writer coalesces bursts of changes.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plugin.atomicfile import write_atomic

log = logging.getLogger(__name__)


class StateStore:
    """Durable state in the state dir: one JSON file, written whole to a temp file, fsynced, then renamed, so a
    crash mid-write leaves the previous version intact."""

    FILE = "state.json"
    VERSION = 1

    def __init__(self, state_dir: Path) -> None:
        self.dir = state_dir
        self.path = state_dir / self.FILE

    def load(self) -> dict[str, Any]:
        try:
            doc = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            # A corrupt file must not stop the plugin; keep it aside for a human and start from nothing.
            aside = self.path.with_suffix(".corrupt")
            log.error("state file %s unreadable (%s); moved to %s, starting without saved state",
                      self.path, exc, aside.name)
            try:
                os.replace(self.path, aside)
            except OSError:
                pass
            return {}
        if not isinstance(doc, dict) or doc.get("version") != self.VERSION:
            log.error("state file %s has an unknown version; ignoring it", self.path)
            return {}
        return doc

    def save(self, doc: dict[str, Any]) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        data = json.dumps({**doc, "version": self.VERSION}, separators=(",", ":")).encode()
        write_atomic(self.path, data)


class Persister:
    """Writes the durable state whenever it is marked dirty, coalescing bursts; a failed write is retried."""

    def __init__(self, store: StateStore, collect: Callable[[], dict[str, Any]], stop: threading.Event,
                 min_interval_s: float = 0.05) -> None:
        self._store = store
        self._collect = collect
        self._stop = stop
        self._dirty = threading.Event()
        self._min_interval = min_interval_s
        self.writes = 0
        self.failures = 0
        self._thread = threading.Thread(target=self._run, name="persister", daemon=True)

    @property
    def started(self) -> bool:
        return self._thread.ident is not None

    def start(self) -> None:
        self._thread.start()

    def mark_dirty(self) -> None:
        self._dirty.set()

    def flush(self) -> None:
        self._store.save(self._collect())
        self.writes += 1

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self._dirty.wait(timeout=0.5):
                continue
            self._dirty.clear()
            try:
                self.flush()
            except OSError as exc:
                self.failures += 1
                log.error("cannot write state to %s: %s (will retry)", self._store.path, exc)
                self._dirty.set()
                self._stop.wait(1.0)
                continue
            self._stop.wait(self._min_interval)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)
