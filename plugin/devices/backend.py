"""The interface every device backend satisfies; nothing outside ``plugin.devices`` knows which one runs."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from plugin.devices.model import Discovery, Gpu, GpuEvent, Reading


class BackendError(Exception):
    """The backend cannot work at all (library missing, init failed); one device's trouble never raises this."""


class Backend(Protocol):
    name: str

    def discover(self) -> Discovery:
        """Return the devices seen now. Must not raise for one device's trouble."""
        ...

    def read(self, gpu: Gpu) -> Reading:
        """Poll one GPU. Never raises: failed signals land in ``Reading.errors`` or ``Reading.lost``."""
        ...

    def wait_events(self, timeout_s: float) -> Sequence[GpuEvent]:
        """Block up to ``timeout_s`` for driver events; return what arrived (possibly nothing)."""
        ...

    def watch(self, on_change: Callable[[], None]) -> None:
        """Call ``on_change`` when the device set or live signals may have changed outside the poll cadence."""
        ...

    def unwatch(self) -> None:
        """Stop what ``watch`` started and return once it has ended: no ``on_change`` call runs or starts after."""
        ...

    def close(self) -> None: ...
