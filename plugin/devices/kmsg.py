"""The kernel log's records (the ``/dev/kmsg`` format) and the NVIDIA driver lines among them. Pure: bytes in,
values out; the reader around it (``kernellog.py``) does the I/O.

A record is ``priority,sequence,timestamp_us,flags[,...];message``, then zero or more continuation lines that start
with a space (the record's ``KEY=value`` dictionary). ``/dev/kmsg`` hands out one record per ``read``; a file or a
FIFO holds them one after another, so both are parsed as lines. The kernel escapes a newline inside a message, so a
line that starts with neither a digit nor a space is not a record.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import StrEnum


class LineKind(StrEnum):
    XID = "xid"  # NVRM: Xid (PCI:dddd:bb:dd): N, ...
    FELL_OFF_BUS = "fell-off-bus"  # NVRM: GPU dddd:bb:dd.f: GPU has fallen off the bus.
    INIT_FAILED = "init-failed"  # NVRM: GPU dddd:bb:dd.f: RmInitAdapter failed! (...)
    SXID = "sxid"  # nvidia-nvswitchN: SXid (PCI:dddd:bb:dd.f): N, ...


KINDS: tuple[LineKind, ...] = tuple(LineKind)

# (domain, bus, device): the driver's lines leave the function out or write it as .0; a GPU is function 0.
PciAddress = tuple[int, int, int]


@dataclass(frozen=True)
class Record:
    seq: int
    time_us: int  # since boot
    message: str


@dataclass(frozen=True)
class DriverLine:
    kind: LineKind
    pci: PciAddress
    code: int = 0  # the XID or SXid; 0 for the others


_ADDR = r"(?:PCI:)?([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?"
_XID = re.compile(r"NVRM: Xid \(" + _ADDR + r"\): (\d{1,5})\b")
_SXID = re.compile(r"nvidia-nvswitch\d*: SXid \(" + _ADDR + r"\): (\d{1,6})\b")
_FELL = re.compile(r"NVRM: .*?\b" + _ADDR + r"\b.*fallen off the bus")
_INIT = re.compile(r"NVRM: GPU " + _ADDR + r": RmInitAdapter failed")
_PREFIX = re.compile(rb"^(\d{1,3}),(\d{1,20}),(\d{1,20}),[^;]*;")


def pci_address(text: str) -> PciAddress | None:
    """NVML's ``00000000:3B:00.0``, the driver's ``PCI:0000:3b:00`` and sysfs's ``0000:3b:00.0`` alike."""
    m = re.fullmatch(_ADDR, text.strip())
    return None if m is None else (int(m[1], 16), int(m[2], 16), int(m[3], 16))


def pci_text(pci: PciAddress) -> str:
    return f"{pci[0]:04x}:{pci[1]:02x}:{pci[2]:02x}.0"


def parse_record(line: bytes) -> Record | None:
    """One record's first line (without its newline); None when it is not one (counted as malformed by the
    caller). Bytes that are not UTF-8 stay readable: the message is for matching and logging only."""
    m = _PREFIX.match(line)
    if m is None:
        return None
    return Record(int(m[2]), int(m[3]), line[m.end():].decode("utf-8", "replace"))


def driver_line(message: str) -> DriverLine | None:
    """The NVIDIA driver line a message is, if any. Cheap for every other line: one substring test each."""
    if "NVRM" in message:
        if (m := _XID.search(message)) is not None:
            return DriverLine(LineKind.XID, _pci(m), int(m[4]))
        if "fallen off the bus" in message and (m := _FELL.search(message)) is not None:
            return DriverLine(LineKind.FELL_OFF_BUS, _pci(m))
        if "RmInitAdapter" in message and (m := _INIT.search(message)) is not None:
            return DriverLine(LineKind.INIT_FAILED, _pci(m))
        return None
    if "SXid" in message and (m := _SXID.search(message)) is not None:
        return DriverLine(LineKind.SXID, _pci(m), int(m[4]))
    return None


def _pci(m: re.Match[str]) -> PciAddress:
    return int(m[1], 16), int(m[2], 16), int(m[3], 16)
