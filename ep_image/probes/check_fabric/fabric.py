"""What this node offers internode expert parallelism, read from sysfs, procfs and /dev.

check_fabric's facts. Every reader takes ``root`` (``/`` on a node, a built tree in tests) and
returns None, False or [] for an absent file instead of raising; library look-ups ask this
process's loader paths. See docs/probes.md, section "check-fabric".
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import subprocess
from pathlib import Path
from typing import Any

#: NVIDIA's PCI vendor id; GPUs are PCI class 0x0300 (VGA) or 0x0302 (3D controller).
NVIDIA_VENDOR = "0x10de"
GPU_CLASSES = ("0x0300", "0x0302")
_BDF = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
#: PCI relations, closest first, with nvidia-smi topo's names.
RELATIONS = ("PIX", "PXB", "PHB", "NODE", "SYS")
#: Environment variables that decide how NVSHMEM (DeepEP v1) and NCCL (all three backends,
#: and DeepEP v2's GIN) reach the network. Reported verbatim.
NVSHMEM_ENV = (
    "NVSHMEM_DIR",
    "NVSHMEM_REMOTE_TRANSPORT",
    "NVSHMEM_IB_ENABLE_IBGDA",
    "NVSHMEM_IBGDA_NIC_HANDLER",
    "NVSHMEM_HCA_LIST",
    "NVSHMEM_HCA_PE_MAPPING",
    "NVSHMEM_ENABLE_NIC_PE_MAPPING",
    "NVSHMEM_IB_SL",
    "NVSHMEM_DISABLE_P2P",
    "NVSHMEM_BOOTSTRAP",
)
NCCL_ENV = (
    "NCCL_NET",
    "NCCL_NET_PLUGIN",
    "NCCL_IB_HCA",
    "NCCL_IB_DISABLE",
    "NCCL_IB_GID_INDEX",
    "NCCL_SOCKET_IFNAME",
    "NCCL_NET_GDR_LEVEL",
    "NCCL_DMABUF_ENABLE",
    "NCCL_GIN_TYPE",
    "EP_DISABLE_GIN",
)


def read(path: Path) -> str | None:
    """A sysfs/procfs attribute, stripped; None when absent or unreadable."""
    try:
        return path.read_text(encoding="utf-8", errors="replace").strip()
    except OSError:
        return None


def parse_state(text: str | None) -> tuple[int | None, str | None]:
    """``"4: ACTIVE"`` -> ``(4, "ACTIVE")``; the kernel writes port states as code: name."""
    if not text:
        return None, None
    code, sep, name = text.partition(":")
    if not sep:
        return None, text.strip()
    try:
        return int(code), name.strip()
    except ValueError:
        return None, text.strip()


def parse_rate(text: str | None) -> float | None:
    """``"400 Gb/sec (4X NDR)"`` -> 400.0 (Gb/s); None when there is no leading number."""
    match = re.match(r"\s*([0-9]+(?:\.[0-9]+)?)\s*Gb/sec", text or "")
    return float(match.group(1)) if match else None


def pci_chain(path: Path) -> list[str]:
    """The PCI path of a device: host bridge first (``pci0000:16``), then each bridge, itself.

    ``path`` is any sysfs link to the device (``/sys/class/infiniband/mlx5_0/device``,
    ``/sys/bus/pci/devices/<bdf>``); links are resolved, so the chain is the real topology.
    """
    parts = Path(os.path.realpath(path)).parts
    for i, part in enumerate(parts):
        if part.startswith("pci") and ":" in part:
            return [part, *(p for p in parts[i + 1 :] if _BDF.match(p))]
    return []


def relation(a: list[str], b: list[str], numa_a: int | None, numa_b: int | None) -> str:
    """How two PCI devices connect, in nvidia-smi topo's words (closest first).

    PIX: the same bridge directly above both; PXB: bridges shared below the host bridge
    (one PCIe switch); PHB: only the host bridge (root complex) shared; NODE: different root
    complexes of one NUMA node; SYS: across NUMA nodes (or unknown).
    """
    if not a or not b:
        return "SYS"
    common = 0
    for x, y in zip(a[:-1], b[:-1], strict=False):
        if x != y:
            break
        common += 1
    if common >= 2:
        return "PIX" if len(a) - common == 1 and len(b) - common == 1 else "PXB"
    if common == 1:
        return "PHB"
    if numa_a is not None and numa_a >= 0 and numa_a == numa_b:
        return "NODE"
    return "SYS"


def _int(text: str | None) -> int | None:
    try:
        return int(text) if text is not None else None
    except ValueError:
        return None


@dataclasses.dataclass
class Port:
    """One port of an RDMA device as the kernel reports it."""

    port: int
    state: str | None
    state_code: int | None
    phys_state: str | None
    phys_state_code: int | None
    link_layer: str | None
    rate: str | None
    rate_gbps: float | None

    @property
    def active(self) -> bool:
        """Usable for traffic: logical state ACTIVE (4) and physical state LinkUp (5)."""
        return self.state_code == 4 and self.phys_state_code == 5


@dataclasses.dataclass
class RdmaDevice:
    """An RDMA device (HCA) under /sys/class/infiniband, with its PCI place and ports."""

    name: str
    hca_type: str | None
    fw_ver: str | None
    node_guid: str | None
    pci: str | None
    pci_chain: list[str]
    numa_node: int | None
    netdevs: list[str]
    ports: list[Port]

    def to_json(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for port, obj in zip(self.ports, data["ports"], strict=True):
            obj["active"] = port.active
        return data


def rdma_devices(root: Path) -> list[RdmaDevice]:
    """Every device under ``root``/sys/class/infiniband, in name order."""
    base = root / "sys" / "class" / "infiniband"
    try:
        names = sorted(p.name for p in base.iterdir())
    except OSError:
        return []
    devices = []
    for name in names:
        dev = base / name
        pci_dev = dev / "device"
        chain = pci_chain(pci_dev) if pci_dev.exists() else []
        ports = []
        try:
            port_dirs = sorted((dev / "ports").iterdir(), key=lambda p: _int(p.name) or 0)
        except OSError:
            port_dirs = []
        for pdir in port_dirs:
            state_code, state = parse_state(read(pdir / "state"))
            phys_code, phys = parse_state(read(pdir / "phys_state"))
            rate = read(pdir / "rate")
            ports.append(
                Port(
                    port=_int(pdir.name) or 0,
                    state=state,
                    state_code=state_code,
                    phys_state=phys,
                    phys_state_code=phys_code,
                    link_layer=read(pdir / "link_layer"),
                    rate=rate,
                    rate_gbps=parse_rate(rate),
                )
            )
        try:
            netdevs = sorted(p.name for p in (pci_dev / "net").iterdir())
        except OSError:
            netdevs = []
        devices.append(
            RdmaDevice(
                name=name,
                hca_type=read(dev / "hca_type"),
                fw_ver=read(dev / "fw_ver"),
                node_guid=read(dev / "node_guid"),
                pci=chain[-1] if chain else None,
                pci_chain=chain,
                numa_node=_int(read(pci_dev / "numa_node")),
                netdevs=netdevs,
                ports=ports,
            )
        )
    return devices


def uverbs_nodes(root: Path) -> dict[str, dict[str, Any]]:
    """RDMA device -> its verbs character device and whether ``/dev`` has it.

    The kernel lists ``/sys/class/infiniband_verbs/uverbs<k>/ibdev`` (the device name); user
    space opens ``/dev/infiniband/uverbs<k>``. A container that sees the NIC in sysfs but
    was not given ``/dev/infiniband`` cannot use it.
    """
    base = root / "sys" / "class" / "infiniband_verbs"
    nodes: dict[str, dict[str, Any]] = {}
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return nodes
    for entry in entries:
        ibdev = read(entry / "ibdev")
        if not ibdev or not entry.name.startswith("uverbs"):
            continue
        dev_path = root / "dev" / "infiniband" / entry.name
        nodes[ibdev] = {"uverbs": entry.name, "dev": str(dev_path), "present": dev_path.exists()}
    return nodes


def module_loaded(root: Path, name: str) -> bool:
    """Whether kernel module ``name`` is loaded (``/sys/module/<name>`` exists)."""
    return (root / "sys" / "module" / name).is_dir()


def kernel_release(root: Path) -> str | None:
    return read(root / "proc" / "sys" / "kernel" / "osrelease")


def kernel_at_least(release: str | None, minimum: tuple[int, int]) -> bool | None:
    """``"6.8.0-45-generic" >= (5, 12)``; None when the release is unknown."""
    match = re.match(r"(\d+)\.(\d+)", release or "")
    if not match:
        return None
    return (int(match.group(1)), int(match.group(2))) >= minimum


def nvidia_driver(root: Path) -> dict[str, Any] | None:
    """The loaded NVIDIA kernel driver: version, open or proprietary modules, its parameters.

    ``/proc/driver/nvidia/version`` reads ``NVRM version: NVIDIA UNIX Open Kernel Module for
    x86_64  580.95.05  Release Build ...`` for the open modules (needed for dma-buf) and
    ``NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.135 ...`` for the proprietary ones.
    ``params`` holds ``EnableStreamMemOPs: 1`` and ``RegistryDwords: "PeerMappingOverride=1;"``
    when the driver is set up for IBGDA. None when no NVIDIA driver is loaded.
    """
    text = read(root / "proc" / "driver" / "nvidia" / "version")
    if text is None:
        return None
    first = text.splitlines()[0] if text else ""
    version = re.search(r"\s(\d+\.\d+(?:\.\d+)?)\s", first + " ")
    params: dict[str, str] = {}
    for line in (read(root / "proc" / "driver" / "nvidia" / "params") or "").splitlines():
        key, sep, value = line.partition(":")
        if sep:
            params[key.strip()] = value.strip().strip('"')
    return {
        "version": version.group(1) if version else None,
        "open": "Open Kernel Module" in first,
        "banner": first,
        "params_readable": bool(params),
        "EnableStreamMemOPs": _int(params.get("EnableStreamMemOPs")),
        "RegistryDwords": params.get("RegistryDwords"),
        "PeerMappingOverride": "PeerMappingOverride=1" in params.get("RegistryDwords", ""),
    }


def gpus(root: Path) -> list[dict[str, Any]]:
    """NVIDIA GPUs on the PCI bus (vendor 0x10de, display class), with their PCI place."""
    base = root / "sys" / "bus" / "pci" / "devices"
    found = []
    try:
        entries = sorted(base.iterdir())
    except OSError:
        return found
    for entry in entries:
        if read(entry / "vendor") != NVIDIA_VENDOR:
            continue
        if not (read(entry / "class") or "").startswith(GPU_CLASSES):
            continue
        found.append(
            {
                "pci": entry.name,
                "pci_chain": pci_chain(entry),
                "numa_node": _int(read(entry / "numa_node")),
            }
        )
    return found


def affinity(gpu_list: list[dict[str, Any]], devices: list[RdmaDevice]) -> list[dict[str, Any]]:
    """For each GPU, the closest RDMA device(s) and how they connect (PIX best, SYS worst).

    Internode EP sends each GPU's tokens through "its" NIC; one behind the same PCIe switch
    (PIX/PXB) keeps GPUDirect RDMA off the CPU's root complex. NCCL and NVSHMEM pick by the
    same distances.
    """
    result = []
    for gpu in gpu_list:
        ranked = sorted(
            (
                RELATIONS.index(
                    relation(gpu["pci_chain"], d.pci_chain, gpu["numa_node"], d.numa_node)
                ),
                d.name,
            )
            for d in devices
        )
        best = ranked[0][0] if ranked else None
        result.append(
            {
                "gpu": gpu["pci"],
                "numa_node": gpu["numa_node"],
                "nearest": [name for rank, name in ranked if rank == best],
                "relation": RELATIONS[best] if best is not None else None,
            }
        )
    return result


def _ldconfig_paths() -> dict[str, str]:
    """soname -> path from the dynamic loader's cache (``ldconfig -p``); {} without it."""
    for exe in ("/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"):
        try:
            out = subprocess.run(
                [exe, "-p"], capture_output=True, text=True, timeout=30, check=False
            ).stdout
        except (OSError, subprocess.SubprocessError):
            continue
        paths: dict[str, str] = {}
        for line in out.splitlines()[1:]:
            name, _, rest = line.strip().partition(" (")
            path = rest.rpartition("=> ")[2].strip()
            if name and path:
                paths.setdefault(name, path)
        return paths
    return {}


_STANDARD_LIB_DIRS = (
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/usr/lib",
    "/lib",
)


def find_libraries(pattern: str) -> list[str]:
    """Files matching ``pattern`` (a regex on the file name) where the loader would look.

    Order as the dynamic loader searches: ``LD_LIBRARY_PATH``, its cache, the standard
    directories. Existence only: nothing is loaded (a net plugin's constructor may start
    threads; an ibverbs provider may probe hardware).
    """
    regex = re.compile(pattern)
    seen: dict[str, None] = {}

    def scan(directories: list[str]) -> None:
        for directory in directories:
            try:
                names = sorted(os.listdir(directory))
            except OSError:
                continue
            for name in names:
                if regex.search(name):
                    seen.setdefault(os.path.join(directory, name), None)

    scan([d for d in os.environ.get("LD_LIBRARY_PATH", "").split(":") if d])
    for name, path in sorted(_ldconfig_paths().items()):
        if regex.search(name):
            seen.setdefault(path, None)
    scan(list(_STANDARD_LIB_DIRS))
    return list(seen)


def nvshmem_lib_dir() -> str | None:
    """NVSHMEM's lib directory: ``$NVSHMEM_DIR/lib``, else the nvidia-nvshmem wheel's."""
    env = os.environ.get("NVSHMEM_DIR")
    if env:
        return str(Path(env) / "lib")
    try:
        spec = importlib.util.find_spec("nvidia.nvshmem")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    lib = Path(next(iter(spec.submodule_search_locations))) / "lib"
    return str(lib) if lib.is_dir() else None


def nvshmem_transports(lib_dir: str | None) -> list[str]:
    """NVSHMEM's remote transports shipped in ``lib_dir`` (``ibgda``, ``ibrc``, ``ucx``...)."""
    if not lib_dir:
        return []
    try:
        names = os.listdir(lib_dir)
    except OSError:
        return []
    found = {m.group(1) for n in names if (m := re.match(r"nvshmem_transport_(\w+)\.so", n))}
    return sorted(found)


def hca_filter_matches(spec: str, names: list[str]) -> list[str]:
    """Device names an ``NCCL_IB_HCA`` / ``NVSHMEM_HCA_LIST`` value selects.

    Syntax as NCCL documents it: comma-separated ``name[:port]`` entries, matched as
    prefixes unless the list starts with ``=`` (exact names); a leading ``^`` excludes the
    listed devices instead.
    """
    text = spec.strip()
    exclude = text.startswith("^")
    text = text.lstrip("^")
    exact = text.startswith("=")
    text = text.lstrip("=")
    wanted = [entry.split(":")[0].strip() for entry in text.split(",") if entry.strip()]

    def hit(name: str) -> bool:
        return any(name == w if exact else name.startswith(w) for w in wanted)

    return [n for n in names if hit(n) != exclude]


def env_values(names: tuple[str, ...]) -> dict[str, str]:
    """The variables of ``names`` that are set, with their values."""
    return {name: os.environ[name] for name in names if name in os.environ}
