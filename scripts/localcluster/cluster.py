"""A whole Kubernetes cluster on this machine, for trying the plugin and for tests/e2e: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler, a kubelet, containerd with runc and the CNI bridge plugin, all real and
all run as processes this module starts, records and stops (docs/local-cluster.md).

Everything it makes lives under one work dir (WORK_DIR), except what the kubelet insists on: the device-plugin
directory /var/lib/kubelet/device-plugins (fixed in the kubelet), the cluster's bridge interface, one cgroup per
hierarchy, and the symlinks the kubelet puts in /var/log/containers. Each of those is recorded when made and
removed by ``down``, which also works on whatever a failed or interrupted ``up`` left.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent.parent
WORK_DIR = Path("/var/lib/gpu-health-local-cluster")
DEVICE_PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
CONTAINER_LOG_LINKS = Path("/var/log/containers")
NODE_NAME = "gpu-local"
BRIDGE = "ghlc0"
# A /24 for the node and its pods; nothing routes it anywhere (no NAT, no default route in pods).
SUBNET = ipaddress.ip_network("10.213.0.0/24")
NODE_IP = str(SUBNET.network_address + 1)
# Fixed ports, so the committed overlay (manifests/overlays/local-cluster) can name the API server; chosen away
# from the ones a real control plane or kubelet uses, so both can share a machine.
API_PORT = 16443
ETCD_PORT = 12379
ETCD_PEER_PORT = 12380
KUBELET_PORT = 20250
KUBELET_HEALTHZ_PORT = 20248
CGROUP_ROOT = "/gpu-health-local-cluster"
V1_CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "systemd", "pids", "blkio", "devices", "freezer")
CNI_BIN_DIRS = (Path("/usr/lib/cni"), Path("/opt/cni/bin"))
# The kubelet sets these at start unless protectKernelDefaults; down puts back what the host had.
KERNEL_TUNABLES = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic", "kernel/panic_on_oops",
                   "kernel/keys/root_maxkeys", "kernel/keys/root_maxbytes")
FEATURE_GATES = "ResourceHealthStatus=true"
COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "containerd", "kubelet")


class ClusterError(RuntimeError):
    """A reason the cluster cannot start or stop, in one line for the user."""


def log(msg: str) -> None:
    print(f"local-cluster: {msg}", flush=True, file=__import__("sys").stderr)


# Layout ------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Layout:
    work: Path = WORK_DIR

    @property
    def bin(self) -> Path:
        return self.work / "bin"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def run(self) -> Path:
        return self.work / "run"

    @property
    def pki(self) -> Path:
        return self.work / "pki"

    @property
    def kubeconfig(self) -> Path:
        return self.work / "admin.kubeconfig"

    @property
    def node_dir(self) -> Path:
        # A directory, not the file, is mounted into the plugin's pod: a fault injector replaces the file
        # atomically (rename), and a file bind mount would keep showing the old inode.
        return self.work / "node"

    @property
    def node_file(self) -> Path:
        return self.node_dir / "node.json"

    @property
    def dev_root(self) -> Path:
        return self.work / "devroot"

    @property
    def boot_dir(self) -> Path:
        # A directory, mounted whole (overlays/local-cluster-reboot): `reboot` replaces the file by rename.
        return self.work / "boot"

    @property
    def boot_id_file(self) -> Path:
        """The node's boot id as the plugin reads it (--boot-id-file): the host's /proc/sys/kernel/random/boot_id
        cannot change without rebooting this machine, so the cluster keeps its own, which `reboot` changes."""
        return self.boot_dir / "boot_id"

    @property
    def nvml_lib_dir(self) -> Path:
        """The NVML stand-in's libnvidia-ml.so.1, where a driver install would put its library on the host; the
        nvml overlay (manifests/components/local-cluster-nvml) mounts it where the image looks for a driver's."""
        return self.work / "nvml" / "lib"

    @property
    def nvml_node_dir(self) -> Path:
        # Its own directory, mounted whole: the stand-in watches the file's directory and sees a fault injector's
        # atomic rename there, which a file bind mount would hide.
        return self.work / "nvml" / "node"

    @property
    def nvml_node_file(self) -> Path:
        """The node file the NVML stand-in answers from (GHDP_NVML_STANDIN_NODE): edit it to inject faults."""
        return self.nvml_node_dir / "node.json"

    @property
    def kubelet_root(self) -> Path:
        return self.work / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        """CDI specs (DRA mode writes one per prepared claim): the cluster's containerd reads only this one."""
        return self.work / "cdi"

    @property
    def containerd(self) -> Path:
        return self.work / "containerd"

    @property
    def containerd_socket(self) -> Path:
        return self.containerd / "containerd.sock"

    @property
    def state_file(self) -> Path:
        return self.work / "cluster.json"

    @property
    def made_file(self) -> Path:
        # What up made outside the work dir, written before each thing is made, so down can undo a half-done up.
        return self.work / "made.json"


# Small helpers -----------------------------------------------------------------------------------------------------

def run(argv: list[str], check: bool = True, timeout: float = 120, **kw: Any) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **kw)
    if check and proc.returncode != 0:
        out = (proc.stderr or proc.stdout).strip().splitlines()
        raise ClusterError(f"{' '.join(argv[:3])} failed: {out[-1] if out else 'exit ' + str(proc.returncode)}")
    return proc


def wait_until(what: str, predicate: Callable[[], bool], timeout: float, interval: float = 0.25,
               why: Callable[[], str] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}" + (f": {why()}" if why else ""))
        time.sleep(interval)


def tail(path: Path, lines: int = 5) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child of ours still answers kill(0).
    with contextlib.suppress(OSError):
        if Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z":
            return False
    return True


def cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    except OSError:
        return []


def all_pids() -> list[int]:
    return [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()]


# Preconditions -----------------------------------------------------------------------------------------------------

def cgroup_version() -> int:
    return 2 if Path("/sys/fs/cgroup/cgroup.controllers").exists() else 1


def require_root() -> None:
    if os.geteuid() != 0:
        raise ClusterError("must run as root (the kubelet, containerd and runc need it)")


def check_host(layout: Layout) -> None:
    """Refuse, with one line saying what is missing, before anything is made."""
    require_root()
    filesystems = Path("/proc/filesystems").read_text()
    if "overlay" not in filesystems:
        if shutil.which("modprobe"):
            run(["modprobe", "overlay"], check=False)
        if "overlay" not in Path("/proc/filesystems").read_text():
            raise ClusterError("the kernel has no overlay filesystem (containerd's snapshotter needs it)")
    if not Path("/proc/self/ns/net").exists():
        raise ClusterError("the kernel has no network namespaces (pods need them)")
    if shutil.which("ip") is None:
        raise ClusterError("`ip` (iproute2) is missing")
    if cni_bin_dir() is None:
        raise ClusterError("no CNI plugins (bridge, host-local, loopback) in /usr/lib/cni or /opt/cni/bin: "
                           "install Debian's containernetworking-plugins")
    if cgroup_version() == 1:
        missing = [c for c in V1_CONTROLLERS if not Path("/sys/fs/cgroup", c).is_dir()]
        if missing:
            raise ClusterError(f"cgroup v1 hierarchies missing: {', '.join(missing)}")
    sock = DEVICE_PLUGIN_DIR / "kubelet.sock"
    if sock.exists() and _socket_answers(sock):
        raise ClusterError(f"{sock} answers: a kubelet already runs on this machine; the local cluster would "
                           "take over its device-plugin directory")
    for port in (API_PORT, ETCD_PORT, ETCD_PEER_PORT, KUBELET_HEALTHZ_PORT):
        if _port_in_use("127.0.0.1", port):
            raise ClusterError(f"port 127.0.0.1:{port} is in use")
    for net in _host_networks():
        if net.overlaps(SUBNET):
            raise ClusterError(f"{SUBNET} overlaps a network of this host ({net}); the cluster's bridge needs it")


def cni_bin_dir() -> Path | None:
    for d in CNI_BIN_DIRS:
        if all((d / p).is_file() for p in ("bridge", "host-local", "loopback")):
            return d
    return None


def _socket_answers(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.settimeout(1)
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def _port_in_use(host: str, port: int) -> bool:
    s = socket.socket()
    try:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0
    finally:
        s.close()


def _host_networks() -> list[ipaddress.IPv4Network]:
    out = run(["ip", "-4", "-j", "addr"], check=False).stdout or "[]"
    nets = []
    for link in json.loads(out):
        for a in link.get("addr_info", []):
            nets.append(ipaddress.IPv4Network(f"{a['local']}/{a['prefixlen']}", strict=False))
    return nets


# What up made outside the work dir ---------------------------------------------------------------------------------

class Made:
    """Outside-the-work-dir things up made, on disk before each is made (so an interrupted up is undone too)."""

    def __init__(self, layout: Layout) -> None:
        self.path = layout.made_file
        self.items: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {}

    def note(self, key: str, value: Any) -> None:
        self.items[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.items, indent=1))
        os.replace(tmp, self.path)


# Pieces of up ------------------------------------------------------------------------------------------------------

def link_binaries(layout: Layout, paths: dict[str, Path]) -> None:
    layout.bin.mkdir(parents=True, exist_ok=True)
    for name, path in paths.items():
        link = layout.bin / name
        link.unlink(missing_ok=True)
        link.symlink_to(path)


def make_pki(layout: Layout) -> dict[str, str]:
    """The peer's throw-away CA and serving certificate, plus a client certificate for the API server's calls to
    the kubelet (logs, exec), and one token per component."""
    run([str(layout.bin / "testpki"), str(layout.pki)])
    key, csr, crt = (layout.pki / n for n in ("kubelet-client.key", "kubelet-client.csr", "kubelet-client.crt"))
    run(["openssl", "ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(key)])
    run(["openssl", "req", "-new", "-key", str(key), "-subj", "/O=system:masters/CN=kube-apiserver-kubelet-client",
         "-out", str(csr)])
    run(["openssl", "x509", "-req", "-in", str(csr), "-CA", str(layout.pki / "ca.crt"), "-CAkey",
         str(layout.pki / "ca.key"), "-CAcreateserial", "-days", "30", "-out", str(crt)])
    tokens = {who: secrets.token_hex(24) for who in ("admin", "kubelet", "scheduler", "controller-manager")}
    users = {
        "admin": ("admin", "system:masters"),
        "kubelet": (f"system:node:{NODE_NAME}", "system:nodes"),
        "scheduler": ("system:kube-scheduler", ""),
        "controller-manager": ("system:kube-controller-manager", ""),
    }
    lines = [f'{tokens[w]},{u},{w}-uid,"{g}"' if g else f"{tokens[w]},{u},{w}-uid" for w, (u, g) in users.items()]
    token_file = layout.pki / "tokens.csv"
    token_file.write_text("\n".join(lines) + "\n")
    token_file.chmod(0o600)
    for who, token in tokens.items():
        write_kubeconfig(layout.work / f"{who}.kubeconfig", layout.pki / "ca.crt", token, who)
    return tokens


def write_kubeconfig(path: Path, ca: Path, token: str, user: str) -> None:
    doc = {
        "apiVersion": "v1", "kind": "Config", "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": f"https://127.0.0.1:{API_PORT}",
                                                   "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": user}}],
    }
    path.write_text(json.dumps(doc, indent=1))
    path.chmod(0o600)


def make_node_files(layout: Layout) -> None:
    from plugin.devices.simulated import builtin_node, write_node_file

    layout.node_dir.mkdir(parents=True, exist_ok=True)
    doc = builtin_node()
    write_node_file(layout.node_file, doc)
    # Device nodes for Allocate's device specs: containerd lstat()s every host path it is given. They carry
    # NVIDIA's major number; nothing opens them without the driver.
    dev = layout.dev_root / "dev"
    dev.mkdir(parents=True, exist_ok=True)
    nodes = {f"nvidia{g.get('minor', g['index'])}": g.get("minor", g["index"]) for g in doc["gpus"]}
    nodes["nvidiactl"] = 255
    for name, minor in nodes.items():
        path = dev / name
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(195, minor))


def make_nvml_files(layout: Layout, standin_dir: Path) -> None:
    """The NVML stand-in's library and its node file: the same 8 GPUs as the simulated node file, as H100 SXM."""
    from plugin.devices.simulated import builtin_node, write_node_file
    from scripts.nvmlstandin import LIBRARY

    layout.nvml_lib_dir.mkdir(parents=True, exist_ok=True)
    # A copy, not a link into the build cache: the pod mounts this directory, and a symlink would point at a path
    # that does not exist inside it.
    shutil.copyfile(standin_dir / LIBRARY, layout.nvml_lib_dir / LIBRARY)
    (layout.nvml_lib_dir / LIBRARY).chmod(0o755)
    layout.nvml_node_dir.mkdir(parents=True, exist_ok=True)
    doc = builtin_node()
    doc["nvml"] = {"profile": "h100-sxm"}
    write_node_file(layout.nvml_node_file, doc)


def build_nvml_standin() -> Path:
    """The directory of the NVML stand-in's libnvidia-ml.so.1 (scripts/nvmlstandin.py), built once and cached. It
    needs gcc and Go, which the cluster's own binaries (runc with cgo) need already."""
    from scripts import nvmlstandin

    try:
        return nvmlstandin.build()
    except (nvmlstandin.StandinToolchainMissing, nvmlstandin.StandinBuildError) as exc:
        raise ClusterError(f"building the NVML stand-in failed: {str(exc).splitlines()[0]}") from exc


def make_bridge(made: Made) -> None:
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        return
    made.note("bridge", BRIDGE)
    run(["ip", "link", "add", BRIDGE, "type", "bridge"])
    run(["ip", "addr", "add", f"{NODE_IP}/{SUBNET.prefixlen}", "dev", BRIDGE])
    run(["ip", "link", "set", BRIDGE, "up"])


def write_cni_config(layout: Layout) -> Path:
    conf_dir = layout.work / "cni" / "net.d"
    conf_dir.mkdir(parents=True, exist_ok=True)
    hosts = list(SUBNET.hosts())
    conf = {
        "cniVersion": "1.0.0", "name": "gpu-health-local",
        "plugins": [{
            "type": "bridge", "bridge": BRIDGE,
            # No gateway and no masquerade: pods reach the node and each other on this bridge, and nothing else.
            "isGateway": False, "ipMasq": False, "hairpinMode": True,
            "ipam": {"type": "host-local", "dataDir": str(layout.work / "cni" / "ipam"),
                     "ranges": [[{"subnet": str(SUBNET), "rangeStart": str(hosts[9]), "rangeEnd": str(hosts[-1])}]]},
        }, {"type": "loopback"}],
    }
    (conf_dir / "10-gpu-health-local.conflist").write_text(json.dumps(conf, indent=1))
    return conf_dir


def write_containerd_config(layout: Layout, pause_ref: str) -> Path:
    c = layout.containerd
    for d in ("root", "state", "runc", "tmp"):
        (c / d).mkdir(parents=True, exist_ok=True)
    layout.cdi_dir.mkdir(parents=True, exist_ok=True)
    conf_dir = write_cni_config(layout)
    cni_bin = cni_bin_dir()
    text = f"""version = 3
root = "{c / 'root'}"
state = "{c / 'state'}"
temp = "{c / 'tmp'}"
# The opt plugin installs into /opt/containerd and NRI listens in /var/run/nri: neither belongs on a host that
# only borrows this containerd.
disabled_plugins = ["io.containerd.internal.v1.opt", "io.containerd.nri.v1.nri"]

[grpc]
  address = "{layout.containerd_socket}"

[ttrpc]
  address = "{c / 'containerd.sock.ttrpc'}"

[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = "{pause_ref}"

[plugins.'io.containerd.cri.v1.runtime']
  # This machine refuses to lower oom_score_adj, which the pause container asks for: without this every
  # sandbox fails with "can't get final child's PID from pipe: EOF".
  restrict_oom_score_adj = true
  # Pod network namespaces under our state dir, not /var/run/netns.
  netns_mounts_under_state_dir = true
  # CDI devices (from the DRA driver) resolve from the cluster's own spec dir, never the host's /etc/cdi.
  cdi_spec_dirs = ["{layout.cdi_dir}"]

[plugins.'io.containerd.cri.v1.runtime'.cni]
  bin_dirs = ["{cni_bin}"]
  conf_dir = "{conf_dir}"
  max_conf_num = 1

[plugins.'io.containerd.cri.v1.runtime'.containerd]
  default_runtime_name = "runc"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

[plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
  BinaryName = "{layout.bin / 'runc'}"
  Root = "{c / 'runc'}"
  SystemdCgroup = false
"""
    path = c / "config.toml"
    path.write_text(text)
    return path


def make_cgroups(made: Made) -> None:
    """The kubelet's cgroupRoot must exist in every v1 hierarchy before it starts."""
    if cgroup_version() == 2:
        base = Path("/sys/fs/cgroup") / CGROUP_ROOT.lstrip("/")
        made.note("cgroups", [str(base)])
        base.mkdir(exist_ok=True)
        return
    made.note("cgroups", [str(Path("/sys/fs/cgroup", c) / CGROUP_ROOT.lstrip("/")) for c in V1_CONTROLLERS])
    for c in V1_CONTROLLERS:
        d = Path("/sys/fs/cgroup", c) / CGROUP_ROOT.lstrip("/")
        d.mkdir(exist_ok=True)
        if c == "cpuset":
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text(Path("/sys/fs/cgroup/cpuset", f).read_text())


def save_tunables(made: Made) -> None:
    if "sysctl" in made.items:
        return
    values = {}
    for t in KERNEL_TUNABLES:
        with contextlib.suppress(OSError):
            values[t] = Path("/proc/sys", t).read_text().strip()
    made.note("sysctl", values)


def write_kubelet_config(layout: Layout) -> Path:
    root = layout.kubelet_root
    root.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration",
        "address": NODE_IP, "port": KUBELET_PORT, "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1", "healthzPort": KUBELET_HEALTHZ_PORT,
        "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                           "x509": {"clientCAFile": str(layout.pki / "ca.crt")}},
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{layout.containerd_socket}",
        "cgroupDriver": "cgroupfs", "cgroupRoot": CGROUP_ROOT, "cgroupsPerQOS": True,
        "failSwapOn": False,
        # Pods get no resolver: nothing in this cluster may look up, or talk to, names outside it.
        "resolvConf": "",
        "podLogsDir": str(layout.logs / "pods"),
        # Imported images cannot be pulled again: never collect them, never evict for disk below 1%.
        "imageGCHighThresholdPercent": 100, "imageGCLowThresholdPercent": 99,
        "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%", "imagefs.available": "1%",
                         "nodefs.inodesFree": "1%"},
        "featureGates": {"ResourceHealthStatus": True},
        "serializeImagePulls": False,
    }
    if cgroup_version() == 1:
        # Kubernetes 1.35+ refuses cgroup v1 unless told otherwise; cgroup v2 hosts need nothing here.
        cfg["failCgroupV1"] = False
    path = root / "config.yaml"
    path.write_text(json.dumps(cfg, indent=1))  # JSON is YAML
    return path


# A reboot of the one node ------------------------------------------------------------------------------------------

# The signals of the simulated node file (docs/simulated-node.md) that live in the driver and the GPU's volatile
# state, and so do not survive a reboot: the event lists (what the next boot reads is a fresh driver's), a lost GPU
# back on the bus, the driver's recovery request, the volatile error counters, a pending row remap or page
# retirement (done at the next driver load). What the GPU keeps (a row-remap failure, the retired pages' count), a
# hot GPU, a slow link, a link or fabric still down, stay as they are: a reboot does not mend those.
REBOOT_CLEARS = ("xid_events", "mig_events", "lost", "nvml_error", "recovery_action", "reset_required",
                 "ecc_uncorrected_volatile", "ecc_corrected_volatile", "pcie_replay_count", "nvlink_error_count",
                 "row_remap_pending", "retired_pages_pending")


def write_boot_id(layout: Layout, boot_id: str | None = None) -> str:
    """A new boot id (a random UUID, as the kernel makes one each boot), replacing the file atomically."""
    import uuid

    value = boot_id or str(uuid.uuid4())
    layout.boot_dir.mkdir(parents=True, exist_ok=True)
    tmp = layout.boot_dir / ".boot_id.tmp"
    tmp.write_text(value + "\n")
    os.replace(tmp, layout.boot_id_file)
    return value


def read_boot_id(layout: Layout) -> str:
    return layout.boot_id_file.read_text().strip()


def clear_volatile_signals(path: Path) -> list[str]:
    """Take what a reboot clears out of a node file (REBOOT_CLEARS), atomically; returns "gpu.<i>.<signal>" for each
    one removed."""
    from plugin.devices.simulated import write_node_file

    doc = json.loads(path.read_text())
    removed = []
    for g in doc.get("gpus", []):
        signals = g.get("signals") or {}
        for key in REBOOT_CLEARS:
            if key in signals:
                del signals[key]
                removed.append(f"gpu.{g['index']}.{key}")
    if removed:
        write_node_file(path, doc)
    return removed


# Processes ---------------------------------------------------------------------------------------------------------

def spawn(layout: Layout, name: str, argv: list[str], env: dict[str, str] | None = None) -> int:
    layout.logs.mkdir(parents=True, exist_ok=True)
    layout.run.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env["PATH"] = f"{layout.bin}:{full_env.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
    full_env.update(env or {})
    # Its own session, so it outlives this command and a Ctrl-C here does not reach it.
    with open(layout.logs / f"{name}.log", "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=full_env, cwd=layout.work)
    (layout.run / f"{name}.pid").write_text(str(proc.pid))
    return proc.pid


def component_pid(layout: Layout, name: str) -> int | None:
    try:
        pid = int((layout.run / f"{name}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if pid_alive(pid) else None


def stop_pid(pid: int, timeout: float = 15) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def https_ok(url: str, layout: Layout, token: str | None = None) -> bool:
    ctx = ssl.create_default_context(cafile=str(layout.pki / "ca.crt"))
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=2, context=ctx) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError, ssl.SSLError):
        return False


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


class Cluster:
    def __init__(self, layout: Layout | None = None) -> None:
        self.layout = layout or Layout()

    # The commands --------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any] | None:
        """The up JSON while every component runs; None when no cluster is up."""
        info = self._info()
        if info is None:
            return None
        dead = [n for n in COMPONENTS if component_pid(self.layout, n) is None]
        return {**info, "running": not dead, "stopped": dead}

    def up(self, images: Callable[[], dict[str, Any]], binaries: Callable[[], dict[str, Path]],
           ready_timeout: float = 180, nvml_standin: Callable[[], Path] = build_nvml_standin) -> dict[str, Any]:
        lay = self.layout
        require_root()
        lay.work.mkdir(parents=True, exist_ok=True)
        with self._lock():
            running = [n for n in COMPONENTS if component_pid(lay, n) is not None]
            if running:
                raise ClusterError(f"a local cluster already runs ({', '.join(running)}); "
                                   "`scripts/local-cluster down` first")
            if lay.made_file.exists() or lay.state_file.exists():
                log("cleaning up what an earlier up left")
                self._teardown()
                lay.work.mkdir(parents=True, exist_ok=True)
            check_host(lay)
            made = Made(lay)
            made.note("work", str(lay.work))
            started = time.monotonic()
            try:
                info = self._up(made, images, binaries, ready_timeout, nvml_standin)
            except BaseException:
                log("up failed; removing what it made (logs are kept in " + str(lay.logs) + " until down)")
                self._teardown(keep_logs=True)
                raise
            info["up_seconds"] = round(time.monotonic() - started, 1)
            lay.state_file.write_text(json.dumps(info, indent=1))
            return info

    def down(self) -> list[str]:
        require_root()
        with self._lock():
            return self._teardown()

    # up, step by step ----------------------------------------------------------------------------------------------

    def _up(self, made: Made, images: Callable[[], dict[str, Any]], binaries: Callable[[], dict[str, Path]],
            ready_timeout: float, nvml_standin: Callable[[], Path]) -> dict[str, Any]:
        lay = self.layout
        log("building or reusing the binaries")
        link_binaries(lay, binaries())
        log("building or reusing the images")
        imgs = images()
        log("building or reusing the NVML stand-in")
        standin = nvml_standin()
        tokens = make_pki(lay)
        make_node_files(lay)
        make_nvml_files(lay, standin)
        write_boot_id(lay)
        (lay.work / "plugin-state").mkdir(exist_ok=True)
        if not DEVICE_PLUGIN_DIR.exists():
            # Record the highest directory we create, so down removes exactly that.
            top = DEVICE_PLUGIN_DIR
            while not top.parent.exists():
                top = top.parent
            made.note("device_plugin_dir", str(top))
            DEVICE_PLUGIN_DIR.mkdir(parents=True)
        made.note("container_log_links_created", not CONTAINER_LOG_LINKS.exists())
        make_bridge(made)
        make_cgroups(made)
        save_tunables(made)

        log("starting etcd and kube-apiserver")
        etcd = f"http://127.0.0.1:{ETCD_PORT}"
        spawn(lay, "etcd", [str(lay.bin / "etcd"), "--name=local", f"--data-dir={lay.work / 'etcd'}",
                            f"--listen-client-urls={etcd}", f"--advertise-client-urls={etcd}",
                            f"--listen-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
                            f"--initial-advertise-peer-urls=http://127.0.0.1:{ETCD_PEER_PORT}",
                            f"--initial-cluster=local=http://127.0.0.1:{ETCD_PEER_PORT}",
                            "--unsafe-no-fsync", "--log-level=warn"])
        self._wait_component("etcd", lambda: http_ok(f"{etcd}/health"), ready_timeout)
        pki = lay.pki
        spawn(lay, "kube-apiserver", [
            str(lay.bin / "kube-apiserver"), f"--etcd-servers={etcd}",
            "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={API_PORT}",
            f"--cert-dir={lay.work / 'apiserver-certs'}",
            f"--tls-cert-file={pki / 'serving.crt'}", f"--tls-private-key-file={pki / 'serving.key'}",
            f"--client-ca-file={pki / 'ca.crt'}", f"--token-auth-file={pki / 'tokens.csv'}",
            "--authorization-mode=Node,RBAC",
            "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
            f"--service-account-key-file={pki / 'sa.pub'}", f"--service-account-signing-key-file={pki / 'sa.key'}",
            "--service-cluster-ip-range=10.214.0.0/24", "--endpoint-reconciler-type=none",
            "--allow-privileged=true", "--profiling=false",
            f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
            f"--kubelet-client-key={pki / 'kubelet-client.key'}",
            "--kubelet-preferred-address-types=InternalIP",
            f"--feature-gates={FEATURE_GATES}",
        ])
        self._wait_component("kube-apiserver", lambda: https_ok(f"https://127.0.0.1:{API_PORT}/readyz", lay,
                                                                 tokens["admin"]), ready_timeout)

        log("starting kube-controller-manager and kube-scheduler")
        spawn(lay, "kube-controller-manager", [
            str(lay.bin / "kube-controller-manager"), f"--kubeconfig={lay.work / 'controller-manager.kubeconfig'}",
            f"--authentication-kubeconfig={lay.work / 'controller-manager.kubeconfig'}",
            f"--authorization-kubeconfig={lay.work / 'controller-manager.kubeconfig'}",
            "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
            f"--root-ca-file={pki / 'ca.crt'}", f"--service-account-private-key-file={pki / 'sa.key'}",
            "--use-service-account-credentials=true", "--controllers=*,-nodeipam",
            f"--feature-gates={FEATURE_GATES}",
        ])
        spawn(lay, "kube-scheduler", [
            str(lay.bin / "kube-scheduler"), f"--kubeconfig={lay.work / 'scheduler.kubeconfig'}",
            f"--authentication-kubeconfig={lay.work / 'scheduler.kubeconfig'}",
            f"--authorization-kubeconfig={lay.work / 'scheduler.kubeconfig'}",
            "--bind-address=127.0.0.1", "--secure-port=0", "--leader-elect=false",
        ])

        log("starting containerd and importing the images")
        config = write_containerd_config(lay, imgs["pause"]["ref"])
        spawn(lay, "containerd", [str(lay.bin / "containerd"), f"--config={config}"])
        self._wait_component("containerd", lambda: lay.containerd_socket.exists() and _socket_answers(
            lay.containerd_socket), ready_timeout)
        for img in imgs.values():
            if img.get("archive") is None:
                continue
            run([str(lay.bin / "ctr"), f"--address={lay.containerd_socket}", "-n", "k8s.io", "images", "import",
                 str(img["archive"])], timeout=300)

        log("starting the kubelet")
        kubelet_cfg = write_kubelet_config(lay)
        spawn(lay, "kubelet", [
            str(lay.bin / "kubelet"), f"--config={kubelet_cfg}", f"--kubeconfig={lay.work / 'kubelet.kubeconfig'}",
            f"--root-dir={lay.kubelet_root}", f"--cert-dir={lay.kubelet_root / 'pki'}",
            f"--hostname-override={NODE_NAME}", f"--node-ip={NODE_IP}",
            "--node-labels=nvidia.com/gpu.present=true", "--v=2",
        ])
        self._wait_component("the node to be Ready", self._node_ready, ready_timeout, "kubelet")
        dead = [n for n in COMPONENTS if component_pid(lay, n) is None]
        if dead:
            raise ClusterError(f"{dead[0]} exited: {tail(lay.logs / f'{dead[0]}.log')}")
        info = self._info_from(imgs)
        return info

    def deploy(self, overlay: str = "local-cluster", timeout: float = 180) -> dict[str, Any]:
        """Apply the plugin the way users do (kubectl apply -k) and wait until the Node advertises its GPUs."""
        if self.status() is None:
            raise ClusterError("no cluster is up: `scripts/local-cluster up` first")
        path = self.overlay(overlay)
        if not (path / "kustomization.yaml").is_file():
            raise ClusterError(f"no overlay {overlay!r} in manifests/overlays")
        self.kubectl("apply", "-k", str(path), timeout=120)
        self.kubectl("-n", "gpu-health-system", "rollout", "status", "daemonset/gpu-health-device-plugin",
                     f"--timeout={int(timeout)}s", timeout=timeout + 10)
        wait_until("the Node to show nvidia.com/gpu", lambda: self.gpu_capacity() > 0, timeout,
                   why=lambda: self.kubectl("-n", "gpu-health-system", "get", "pods", "-o", "wide",
                                            check=False).stdout)
        return {"overlay": str(path), "capacity": self.gpu_capacity()}

    def overlay(self, name: str = "local-cluster") -> Path:
        return REPO / "manifests" / "overlays" / name

    def reboot(self, timeout: float = 120) -> dict[str, Any]:
        """What a reboot of the node does to what runs on it, the control plane left running (it is elsewhere in a
        real cluster): the kubelet stopped, every container stopped (SIGTERM, then SIGKILL after a few seconds),
        containerd and its shims stopped; a new boot id; what a reboot clears taken out of the node files
        (REBOOT_CLEARS); then containerd and the kubelet started again with their command lines, which restart the
        pods' containers. Everything on disk stays, as on a real node: the plugin's state dir
        (<work dir>/plugin-state, the host's /var/lib/gpu-health-device-plugin), the kubelet's and containerd's
        roots. containerd's state dir is on disk here too (a tmpfs /run on a real node): at start containerd finds
        the dead tasks there and cleans them up."""
        lay = self.layout
        started = time.monotonic()
        with self._lock():
            argv = {}
            for name in ("kubelet", "containerd"):
                pid = component_pid(lay, name)
                if pid is None:
                    raise ClusterError(f"{name} is not running: no node to reboot")
                argv[name] = (pid, cmdline(pid))
            old_boot = read_boot_id(lay) if lay.boot_id_file.exists() else ""
            log("reboot: stopping the kubelet, the containers and containerd")
            stop_pid(argv["kubelet"][0])
            _stop_containers(grace=5)
            work = str(lay.work)
            for p in all_pids():
                args = cmdline(p)
                if p != os.getpid() and any(work in a for a in args) and "containerd-shim" in " ".join(args):
                    stop_pid(p, timeout=5)
            stop_pid(argv["containerd"][0])
            boot_id = write_boot_id(lay)
            cleared = [c for f in (lay.node_file, lay.nvml_node_file) if f.exists() for c in clear_volatile_signals(f)]
            log(f"reboot: boot id {boot_id}; cleared {', '.join(cleared) or 'nothing'}; starting containerd and "
                "the kubelet")
            spawn(lay, "containerd", argv["containerd"][1])
            self._wait_component("containerd", lambda: _socket_answers(lay.containerd_socket), timeout)
            spawn(lay, "kubelet", argv["kubelet"][1])
            self._wait_component("the kubelet's healthz", lambda: http_ok(
                f"http://127.0.0.1:{KUBELET_HEALTHZ_PORT}/healthz"), timeout, "kubelet")
        return {"boot_id": boot_id, "previous_boot_id": old_boot, "cleared": cleared,
                "kubelet_pid": component_pid(lay, "kubelet"), "containerd_pid": component_pid(lay, "containerd"),
                "seconds": round(time.monotonic() - started, 1)}

    def import_image(self, archive: Path) -> None:
        """Put an OCI archive into the cluster's containerd, where pods with imagePullPolicy Never find it."""
        run([str(self.layout.bin / "ctr"), f"--address={self.layout.containerd_socket}", "-n", "k8s.io", "images",
             "import", str(archive)], timeout=300)

    def remove_reporting(self) -> None:
        """Run docs/deploy.md's uninstall commands (annotations, node condition) as an administrator would."""
        doc = (REPO / "docs" / "deploy.md").read_text()
        env = dict(os.environ, KUBECONFIG=str(self.layout.kubeconfig), PATH=f"{self.layout.bin}:{os.environ['PATH']}")
        for marker in ("uninstall-annotations", "uninstall-condition"):
            script = doc[doc.index(f"<!-- {marker} -->"):].split("```sh\n", 1)[1].split("```", 1)[0]
            run(["bash", "-eo", "pipefail", "-c", script], env=env)

    def gpu_capacity(self, field: str = "capacity") -> int:
        p = self.kubectl("get", "node", NODE_NAME, "-o", f"jsonpath={{.status.{field}.nvidia\\.com/gpu}}",
                         check=False)
        return int(p.stdout.strip() or 0) if p.returncode == 0 else 0

    def _info_from(self, imgs: dict[str, Any]) -> dict[str, Any]:
        lay = self.layout
        return {
            "kubeconfig": str(lay.kubeconfig),
            "kubectl": str(lay.bin / "kubectl"),
            "node_name": NODE_NAME,
            "node_file": str(lay.node_file),
            "nvml_lib_dir": str(lay.nvml_lib_dir),
            "nvml_node_file": str(lay.nvml_node_file),
            "plugin_image": imgs["plugin"]["ref"],
            "workload_image": imgs["workload"]["ref"],
            "logs": str(lay.logs),
            "work_dir": str(lay.work),
            "node_ip": NODE_IP,
            "api_server": f"https://127.0.0.1:{API_PORT}",
            "containerd_socket": str(lay.containerd_socket),
            "pod_resources_socket": str(lay.kubelet_root / "pod-resources" / "kubelet.sock"),
        }

    def _info(self) -> dict[str, Any] | None:
        try:
            info: dict[str, Any] = json.loads(self.layout.state_file.read_text())
        except (OSError, ValueError):
            return None
        return info

    def _wait_component(self, what: str, ready: Callable[[], bool], timeout: float, name: str | None = None) -> None:
        name = name or what
        def check() -> bool:
            if component_pid(self.layout, name) is None:
                raise ClusterError(f"{name} exited: {tail(self.layout.logs / f'{name}.log')}")
            return ready()
        wait_until(what, check, timeout, why=lambda: tail(self.layout.logs / f"{name}.log", 3))

    def kubectl(self, *args: str, check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        return run([str(self.layout.bin / "kubectl"), f"--kubeconfig={self.layout.kubeconfig}", *args],
                   check=check, timeout=timeout)

    def _node_ready(self) -> bool:
        p = self.kubectl("get", "node", NODE_NAME, "-o",
                         "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False)
        return p.returncode == 0 and p.stdout.strip() == "True"

    # down ----------------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self) -> Iterator[None]:
        self.layout.work.parent.mkdir(parents=True, exist_ok=True)
        path = self.layout.work.parent / f".{self.layout.work.name}.lock"
        with open(path, "w") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ClusterError("another `local-cluster up` or `down` is running") from None
            yield

    def _teardown(self, keep_logs: bool = False) -> list[str]:
        """Stop and remove everything; returns what was removed. Safe to run on nothing, or twice."""
        lay = self.layout
        made = Made(lay) if lay.made_file.exists() else None
        items = made.items if made else {}
        done: list[str] = []
        work = str(lay.work)
        # 1. Containers first (they live in our cgroup), then the kubelet, so it restarts nothing; then
        #    containerd's shims and containerd; then the control plane.
        pid = component_pid(lay, "kubelet")
        if pid:
            stop_pid(pid)
            done.append("kubelet")
        killed = kill_cgroup_members()
        if killed:
            done.append(f"{killed} container processes")
        for p in all_pids():
            if p != os.getpid() and any(work in a for a in cmdline(p)) and "containerd-shim" in " ".join(cmdline(p)):
                stop_pid(p, timeout=5)
                done.append(f"shim {p}")
        for name in reversed(COMPONENTS):
            pid = component_pid(lay, name)
            if pid:
                stop_pid(pid)
                done.append(name)
        # Anything else still running out of our binaries (a component whose pid file was lost).
        for p in all_pids():
            args = cmdline(p)
            if p != os.getpid() and args and args[0].startswith(str(lay.bin)):
                stop_pid(p, timeout=5)
                done.append(f"stray {args[0]}")
        # 2. Mounts under the work dir (container rootfs, netns, kubelet volumes), deepest first.
        for mp in sorted(mounts_under(lay.work, DEVICE_PLUGIN_DIR), key=len, reverse=True):
            r = run(["umount", mp], check=False)
            if r.returncode != 0:
                run(["umount", "-l", mp], check=False)
            done.append(f"umount {mp}")
        # 3. The bridge (veths went with their namespaces).
        if items.get("bridge") and Path(f"/sys/class/net/{items['bridge']}").exists():
            run(["ip", "link", "del", items["bridge"]], check=False)
            done.append(f"bridge {items['bridge']}")
        for link in leftover_veths():
            run(["ip", "link", "del", link], check=False)
            done.append(f"veth {link}")
        # 4. cgroups, deepest first.
        for base in items.get("cgroups", []):
            for d in sorted((p for p in Path(base).rglob("*") if p.is_dir()), key=lambda p: len(p.parts),
                            reverse=True) if Path(base).exists() else []:
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                Path(base).rmdir()
                done.append(f"cgroup {base}")
        # 5. Kernel settings the kubelet changed.
        for t, v in items.get("sysctl", {}).items():
            with contextlib.suppress(OSError):
                if Path("/proc/sys", t).read_text().strip() != v:
                    Path("/proc/sys", t).write_text(v)
                    done.append(f"sysctl {t}={v}")
        # 6. Files outside the work dir, then the work dir itself.
        if CONTAINER_LOG_LINKS.is_dir():
            for entry in CONTAINER_LOG_LINKS.iterdir():
                if entry.is_symlink() and os.readlink(entry).startswith(work):
                    entry.unlink()
            with contextlib.suppress(OSError):
                if items.get("container_log_links_created"):
                    CONTAINER_LOG_LINKS.rmdir()
        if items.get("device_plugin_dir"):
            shutil.rmtree(items["device_plugin_dir"], ignore_errors=True)
            done.append(f"rm {items['device_plugin_dir']}")
        else:
            # Sockets of ours in a directory that was there before us.
            for s in (DEVICE_PLUGIN_DIR.glob("*") if made and DEVICE_PLUGIN_DIR.is_dir() else []):
                if s.is_socket() or s.name == "kubelet_internal_checkpoint":
                    s.unlink(missing_ok=True)
        if lay.work.exists():
            if keep_logs:
                for child in lay.work.iterdir():
                    if child != lay.logs:
                        shutil.rmtree(child, ignore_errors=True) if child.is_dir() and not child.is_symlink() \
                            else child.unlink(missing_ok=True)
            else:
                shutil.rmtree(lay.work, ignore_errors=True)
            done.append(f"rm {lay.work}")
        return done


def _stop_containers(grace: float) -> None:
    """SIGTERM every process in the kubelet's cgroup root, as a shutdown does, then SIGKILL what is left after
    ``grace`` seconds (a shell as a container's PID 1 ignores SIGTERM)."""
    for p in [p for p in all_pids() if in_our_cgroup(p)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and any(in_our_cgroup(p) and pid_alive(p) for p in all_pids()):
        time.sleep(0.1)
    kill_cgroup_members()


def kill_cgroup_members() -> int:
    """SIGKILL every process in the kubelet's cgroup root: the pods' containers."""
    killed = 0
    for _ in range(5):
        pids = [p for p in all_pids() if in_our_cgroup(p)]
        if not pids:
            break
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, signal.SIGKILL)
                killed += 1
        time.sleep(0.2)
    return killed


def in_our_cgroup(pid: int) -> bool:
    try:
        text = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return any(line.split(":", 2)[-1].startswith(CGROUP_ROOT + "/") or line.split(":", 2)[-1] == CGROUP_ROOT
               for line in text.splitlines())


def mounts_under(*roots: Path) -> list[str]:
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mp = line.split()[4].replace("\\040", " ")
        if any(mp == str(r) or mp.startswith(str(r) + "/") for r in roots):
            out.append(mp)
    return out


def leftover_veths() -> list[str]:
    """veth ends still enslaved to our bridge (normally gone with their namespaces)."""
    out = []
    for p in Path("/sys/class/net").iterdir():
        master = p / "master"
        if master.exists() and Path(os.readlink(master)).name == BRIDGE:
            out.append(p.name)
    return out


@dataclass
class Leftovers:
    processes: list[str] = field(default_factory=list)
    mounts: list[str] = field(default_factory=list)
    interfaces: list[str] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)

    def empty(self) -> bool:
        return not (self.processes or self.mounts or self.interfaces or self.paths or self.cgroups)


def leftovers(layout: Layout | None = None) -> Leftovers:
    """What of a cluster is still on the host: what down must have removed."""
    lay = layout or Layout()
    found = Leftovers()
    for p in all_pids():
        args = cmdline(p)
        if p != os.getpid() and (in_our_cgroup(p) or any(str(lay.work) in a for a in args)):
            found.processes.append(f"{p} {' '.join(args)[:120]}")
    found.mounts = mounts_under(lay.work, DEVICE_PLUGIN_DIR)
    if Path(f"/sys/class/net/{BRIDGE}").exists():
        found.interfaces.append(BRIDGE)
    found.interfaces += leftover_veths()
    for path in (lay.work, DEVICE_PLUGIN_DIR / "kubelet.sock", *CONTAINER_LOG_LINKS.glob("*gpu-health*")):
        if path.exists():
            found.paths.append(str(path))
    for c in (*V1_CONTROLLERS, ""):
        d = Path("/sys/fs/cgroup", c) / CGROUP_ROOT.lstrip("/")
        if d.exists():
            found.cgroups.append(str(d))
    return found
