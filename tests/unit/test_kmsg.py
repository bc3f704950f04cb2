"""The kernel log's record format and the NVIDIA driver lines in it, as the kernel and the driver write them."""

from __future__ import annotations

import pytest

from plugin.devices.kmsg import DriverLine, LineKind, Record, driver_line, parse_record, pci_address, pci_text


@pytest.mark.parametrize("raw, want", [
    (b"4,1523,8723412345,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.",
     Record(1523, 8723412345, "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, GPU has fallen off the bus.")),
    # More prefix fields after the flags (the caller id some kernels add) are the prefix's, not the message's.
    (b"6,7,100,-,caller=T512;hello; world", Record(7, 100, "hello; world")),
    (b"6,0,0,c;", Record(0, 0, "")),
    (b"3,9,1,-;bad utf-8 \xff here", Record(9, 1, "bad utf-8 \ufffd here")),
])
def test_a_record_is_its_prefix_and_message(raw: bytes, want: Record) -> None:
    assert parse_record(raw) == want


@pytest.mark.parametrize("raw", [
    b"", b" SUBSYSTEM=pci", b"no prefix at all", b"4,12;missing the timestamp", b"x,1,2,-;not a number",
    b"4,1523,872341", b"-1,2,3,-;negative",
])
def test_what_is_not_a_record_is_refused(raw: bytes) -> None:
    assert parse_record(raw) is None


@pytest.mark.parametrize("message, want", [
    ("NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus.",
     DriverLine(LineKind.XID, (0, 0x3B, 0), 79)),
    ("NVRM: Xid (PCI:0002:c1:00): 13, pid=99, name=train, Graphics SM Warp Exception on (GPC 0, TPC 1, SM 0)",
     DriverLine(LineKind.XID, (2, 0xC1, 0), 13)),
    ("NVRM: Xid (PCI:00000001:AB:00.0): 154, GPU recovery action changed from 0x0 (None) to 0x1 (GPU Reset Required)",
     DriverLine(LineKind.XID, (1, 0xAB, 0), 154)),
    ("NVRM: GPU 0000:3b:00.0: GPU has fallen off the bus.", DriverLine(LineKind.FELL_OFF_BUS, (0, 0x3B, 0))),
    ("NVRM: The NVIDIA GPU 0000:86:00.0 (PCI ID: 10de:2330) installed in this system has fallen off the bus and is "
     "not responding to commands.", DriverLine(LineKind.FELL_OFF_BUS, (0, 0x86, 0))),
    ("NVRM: GPU 0000:5e:00.0: RmInitAdapter failed! (0x26:0x56:1474)", DriverLine(LineKind.INIT_FAILED, (0, 0x5E, 0))),
    ("nvidia-nvswitch3: SXid (PCI:0000:c6:00.0): 24007, Fatal, Link 32 sourcetrack timeout error",
     DriverLine(LineKind.SXID, (0, 0xC6, 0), 24007)),
])
def test_the_driver_lines_name_their_gpu_by_pci_address(message: str, want: DriverLine) -> None:
    assert driver_line(message) == want


@pytest.mark.parametrize("message", [
    "NVRM: loading NVIDIA UNIX x86_64 Kernel Module  570.124.06",
    "NVRM: Xid (PCI:0000:3b:00): , no number",
    "NVRM: Xid (PCI:zzzz:3b:00): 79, not an address",
    "pcieport 0000:00:01.0: AER: Corrected error received: 0000:3b:00.0 (mentions an address, is no driver line)",
    "usb 1-1: new high-speed USB device number 2 using xhci_hcd",
    "nvidia-nvswitch0: probe done",
])
def test_other_lines_are_no_driver_lines(message: str) -> None:
    assert driver_line(message) is None


@pytest.mark.parametrize("text", ["00000000:3B:00.0", "0000:3b:00.0", "PCI:0000:3b:00", "0000:3B:00"])
def test_nvml_driver_and_sysfs_spell_one_address_alike(text: str) -> None:
    assert pci_address(text) == (0, 0x3B, 0)
    assert pci_text((0, 0x3B, 0)) == "0000:3b:00.0"


@pytest.mark.parametrize("text", ["", "3b:00.0", "0000:3b:00.9", "not an address"])
def test_an_address_that_is_none_is_none(text: str) -> None:
    assert pci_address(text) is None
