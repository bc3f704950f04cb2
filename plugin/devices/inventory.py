"""The NVIDIA GPUs on the PCI bus, as sysfs lists them: what a GPU that fell off the bus or never initialised leaves
behind, which NVML cannot report (it lists only the GPUs the driver brought up).

A GPU is a PCI function of vendor 0x10de whose class is a display controller: VGA (0x0300xx) or 3D (0x0302xx).
NVSwitches (bridges, 0x0680xx) and the GPUs' audio functions (0x0403xx) are not GPUs. A GPU bound to another
driver than ``nvidia`` (``vfio-pci``, passed through to a virtual machine) is not the driver's to list and is left
out; one bound to no driver is ours (the driver's probe failed: RmInitAdapter). The root is passed in
(``--sysfs-root``), so tests point it at a directory of their own. Each function's vendor and class are read once:
a listing of the directory and one link per GPU is what a poll costs.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from plugin.devices.kmsg import PciAddress, pci_address

log = logging.getLogger(__name__)

NVIDIA = 0x10DE
GPU_CLASSES = (0x0300, 0x0302)


class PciInventory:
    def __init__(self, sysfs_root: Path) -> None:
        self.devices = sysfs_root / "bus" / "pci" / "devices"
        self._known: dict[str, PciAddress | None] = {}  # function name -> its address if it is an NVIDIA GPU
        self._said = False

    def gpus(self) -> tuple[PciAddress, ...] | None:
        """The NVIDIA GPUs on the bus now, sorted; None when sysfs cannot be read (said once): then nothing is
        known about the bus, which is not the same as no GPU on it."""
        try:
            names = [p.name for p in self.devices.iterdir()]
        except OSError as exc:
            if not self._said:
                log.warning("PCI inventory: cannot list %s (%s); GPUs missing from NVML are found by the expected "
                            "count alone", self.devices, exc.strerror or exc)
                self._said = True
            return None
        self._said = False
        out = set()
        for name in names:
            if name not in self._known:
                self._known[name] = self._gpu_at(name)
            addr = self._known[name]
            if addr is not None and self._ours(name):
                out.add(addr)
        for gone in set(self._known) - set(names):
            del self._known[gone]  # hot-unplugged: read again if it comes back
        return tuple(sorted(out))

    def _ours(self, name: str) -> bool:
        try:
            driver = os.path.basename(os.readlink(self.devices / name / "driver"))
        except OSError:
            return True  # bound to no driver: the nvidia driver's probe of it failed
        return driver == "nvidia"

    def _gpu_at(self, name: str) -> PciAddress | None:
        try:
            vendor = int((self.devices / name / "vendor").read_text().strip(), 16)
            cls = int((self.devices / name / "class").read_text().strip(), 16)
        except (OSError, ValueError):
            return None  # a function that vanished while read, or a file that is not a number: not a GPU we know
        if vendor != NVIDIA or (cls >> 8) not in GPU_CLASSES:
            return None
        return pci_address(name)
