"""check_fabric's command: its flags, its steps (one per link internode EP needs) and report.

Why this module exists: the facts come from ``fabric`` (the node's RDMA, GPUs, driver and
NVSHMEM, read from ``root``) and ``internode`` (the backend's build); this judges them.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ep_image import cli
from ep_image.probes._report import (
    EXIT_OK,
    Status,
    Step,
    StepFailed,
    build_report,
    exit_code_of,
    render_table,
    timed_step,
    write_report,
)
from ep_image.probes.check_fabric import fabric, internode

PROG = "check_fabric"
STEP_NAMES = (
    "rdma_devices",
    "verbs",
    "gpudirect_rdma",
    "ibgda",
    "nccl_net",
    "backend_build",
    "affinity",
)

NO_RDMA_HINT = (
    "internode EP needs an RDMA NIC (InfiniBand or RoCE) with an ACTIVE port: run on a "
    "cluster node that has one; in a container, the host's /sys/class/infiniband must be "
    "visible (docker: --device /dev/infiniband --cap-add IPC_LOCK; enroot/pyxis pass it "
    "through when the host has it)"
)
PORTS_DOWN_HINT = (
    "no port is ACTIVE/LinkUp: check cable and switch (`ibstat`, `ibstatus`); an "
    "InfiniBand port stuck in INIT has no subnet manager (start opensm or fix the fabric's "
    "SM); a RoCE port needs its Ethernet interface up (`ip link set <netdev> up`)"
)
VERBS_HINT = (
    "install rdma-core's user space in the image (Debian/Ubuntu: apt-get install libibverbs1 "
    "ibverbs-providers librdmacm1) and pass the verbs devices into the container (docker: "
    "--device /dev/infiniband; Kubernetes: an RDMA device plugin)"
)
GPUDIRECT_HINT = (
    "load nvidia-peermem (`modprobe nvidia-peermem`, shipped with the driver; add it to "
    "/etc/modules-load.d to keep it), or use the NVIDIA open kernel modules on a kernel >= "
    "5.12 so NCCL and NVSHMEM can register GPU memory through dma-buf"
)
IBGDA_HINT = (
    "enable GPU-initiated RDMA in the driver: put `options nvidia NVreg_EnableStreamMemOPs=1 "
    'NVreg_RegistryDwords="PeerMappingOverride=1;"` in /etc/modprobe.d/nvidia.conf, run '
    "update-initramfs -u and reboot; or load GDRCopy's gdrdrv module for CPU-assisted IBGDA "
    "(slower). DeepEP v1's internode and low-latency kernels need one of them"
)
NO_DRIVER_HINT = (
    "no NVIDIA kernel driver is loaded (/proc/driver/nvidia absent): run on a GPU node; in a "
    "container, use the NVIDIA container runtime (--gpus all) so the driver is visible"
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog="check_fabric.py",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=(
            "Report whether this node can run internode expert parallelism: RDMA devices "
            "and their link state, user-space verbs, GPUDirect RDMA (nvidia-peermem or "
            "dma-buf), GPU-initiated RDMA for NVSHMEM IBGDA, NCCL's network settings and "
            "plugins, and which NIC is nearest each GPU. Each missing piece is named with "
            "its fix. Needs neither torch nor a GPU."
        ),
        epilog="""\
how to run (on every node of the job, inside the image):
  check-fabric
  check-fabric --require --json fabric.json     on a cluster node
  srun --ntasks-per-node 1 check-fabric --require

exit codes:
  0 ready   1 a link is broken (fix printed)   2 bad usage
  5 internode EP cannot run here: no RDMA device or no NVIDIA driver (--require: 1)
""",
    )
    parser.add_json("write the report here as JSON")
    parser.add_require(
        "treat 'cannot run here' (exit 5) as a failure (exit 1): for cluster nodes, "
        "where a missing NIC is a broken node"
    )
    parser.add_argument(
        "--root",
        default="/",
        metavar="DIR",
        help="read sys/, proc/ and dev/ under DIR instead of / (a tree copied from a node, "
        "or one a test built); libraries are still looked up where this process's loader "
        "looks (default: /)",
    )
    args = parser.parse_args(argv)
    if not Path(args.root).is_dir():
        raise cli.UsageError(f"--root {args.root}: not a directory")
    return args


# ------------------------------------------------------------------------------------------
# Facts
# ------------------------------------------------------------------------------------------


def collect(root: Path) -> dict[str, Any]:
    """Every fact the steps judge, gathered once; absent things are None, False or []."""
    devices = fabric.rdma_devices(root)
    gpu_list = fabric.gpus(root)
    lib_dir = fabric.nvshmem_lib_dir()
    release = fabric.kernel_release(root)
    return {
        "root": str(root),
        "devices": devices,
        "uverbs": fabric.uverbs_nodes(root),
        "libibverbs": fabric.find_libraries(r"^libibverbs\.so\.1$"),
        "libmlx5": fabric.find_libraries(r"^libmlx5\.so\.1$"),
        "kernel": release,
        "kernel_dmabuf": fabric.kernel_at_least(release, (5, 12)),
        "driver": fabric.nvidia_driver(root),
        "nvidia_peermem": fabric.module_loaded(root, "nvidia_peermem"),
        "gdrdrv": fabric.module_loaded(root, "gdrdrv"),
        "nvshmem_lib_dir": lib_dir,
        "nvshmem_transports": fabric.nvshmem_transports(lib_dir),
        "nvshmem_env": fabric.env_values(fabric.NVSHMEM_ENV),
        "nccl_env": fabric.env_values(fabric.NCCL_ENV),
        "nccl_net_plugins": fabric.find_libraries(r"^libnccl-net.*\.so"),
        "gpus": gpu_list,
        "affinity": fabric.affinity(gpu_list, devices),
        "backend": internode.backend_internode(),
    }


def active_ports(devices: list[fabric.RdmaDevice]) -> list[tuple[str, fabric.Port]]:
    return [(d.name, p) for d in devices for p in d.ports if p.active]


# ------------------------------------------------------------------------------------------
# Steps: each judges one link of the chain and names its fix
# ------------------------------------------------------------------------------------------


def _port_text(dev: str, port: fabric.Port) -> str:
    layer = {"InfiniBand": "IB", "Ethernet": "RoCE"}.get(port.link_layer or "", port.link_layer)
    return f"{dev}/{port.port} {layer} {port.rate or '?'}"


def not_judged(step: Step, detail: str) -> None:
    """A fact reported, not judged: without an RDMA device internode EP is not possible here
    at all, so what it would need is information, not a failure."""
    step.status = Status.INFO
    step.detail = f"{detail} (not judged: no RDMA device)"


def step_rdma_devices(facts: dict[str, Any]) -> Step:
    with timed_step("rdma_devices") as step:
        devices: list[fabric.RdmaDevice] = facts["devices"]
        step.data = {"devices": [d.to_json() for d in devices]}
        if not devices:
            raise StepFailed(
                Status.SKIP,
                f"no RDMA device ({facts['root'].rstrip('/')}/sys/class/infiniband is absent "
                "or empty)",
                NO_RDMA_HINT,
            )
        active = active_ports(devices)
        if not active:
            states = ", ".join(
                f"{d.name}/{p.port} {p.state or '?'} ({p.phys_state or '?'})"
                for d in devices
                for p in d.ports
            )
            raise StepFailed(
                Status.FAIL,
                f"{len(devices)} RDMA device(s), no ACTIVE port: {states or 'no ports'}",
                PORTS_DOWN_HINT,
            )
        layers = sorted({p.link_layer or "?" for _, p in active})
        step.detail = f"{len(devices)} device(s), {len(active)} active port(s): " + ", ".join(
            _port_text(d, p) for d, p in active
        )
        step.data["active_ports"] = len(active)
        step.data["link_layers"] = layers
    return step


def step_verbs(facts: dict[str, Any], judged: bool) -> Step:
    with timed_step("verbs") as step:
        devices: list[fabric.RdmaDevice] = facts["devices"]
        uverbs: dict[str, dict[str, Any]] = facts["uverbs"]
        active_devs = sorted({d for d, _ in active_ports(devices)})
        step.data = {
            "libibverbs": facts["libibverbs"],
            "libmlx5": facts["libmlx5"],
            "uverbs": uverbs,
        }
        problems = []
        if not facts["libibverbs"]:
            problems.append("libibverbs.so.1 not found (NCCL falls back to TCP sockets)")
        if any(d.startswith("mlx5") for d in active_devs) and not facts["libmlx5"]:
            problems.append("libmlx5.so.1 (mlx5 provider) not found")
        missing = [d for d in active_devs if not uverbs.get(d, {}).get("present")]
        if missing:
            problems.append(
                "no /dev/infiniband/uverbs node for " + ", ".join(missing) + " (not passed in?)"
            )
        found = (
            f"libibverbs {facts['libibverbs'][0] if facts['libibverbs'] else 'absent'}, "
            f"libmlx5 {facts['libmlx5'][0] if facts['libmlx5'] else 'absent'}"
        )
        if not judged:
            not_judged(step, found)
        elif problems:
            raise StepFailed(Status.FAIL, "; ".join(problems), VERBS_HINT)
        else:
            nodes = ", ".join(f"{d}={uverbs[d]['uverbs']}" for d in active_devs)
            step.detail = f"{found}; {nodes}"
    return step


def step_gpudirect(facts: dict[str, Any], judged: bool) -> Step:
    with timed_step("gpudirect_rdma") as step:
        driver = facts["driver"]
        dmabuf = bool(driver and driver["open"] and facts["kernel_dmabuf"])
        step.data = {
            "nvidia_peermem": facts["nvidia_peermem"],
            "dmabuf_possible": dmabuf,
            "kernel": facts["kernel"],
            "driver": driver,
        }
        if driver is None:
            detail = "no NVIDIA kernel driver loaded"
            if not judged:
                not_judged(step, detail)
                return step
            raise StepFailed(Status.SKIP, detail, NO_DRIVER_HINT)
        flavour = "open" if driver["open"] else "proprietary"
        ways = []
        if facts["nvidia_peermem"]:
            ways.append("nvidia-peermem loaded")
        if dmabuf:
            ways.append(f"dma-buf (kernel {facts['kernel']}, open kernel modules)")
        text = f"driver {driver['version']} ({flavour}), kernel {facts['kernel']}: "
        if not judged:
            not_judged(step, text + (", ".join(ways) or "neither"))
        elif not ways:
            raise StepFailed(
                Status.FAIL,
                text
                + "nvidia-peermem not loaded and dma-buf not possible"
                + ("" if driver["open"] else " (proprietary kernel modules)"),
                GPUDIRECT_HINT,
            )
        else:
            step.detail = text + ", ".join(ways)
    return step


def step_ibgda(facts: dict[str, Any], judged: bool) -> Step:
    with timed_step("ibgda") as step:
        driver = facts["driver"]
        env = facts["nvshmem_env"]
        transports = facts["nvshmem_transports"]
        step.data = {
            "EnableStreamMemOPs": driver["EnableStreamMemOPs"] if driver else None,
            "PeerMappingOverride": driver["PeerMappingOverride"] if driver else None,
            "params_readable": driver["params_readable"] if driver else None,
            "gdrdrv": facts["gdrdrv"],
            "nvshmem_lib_dir": facts["nvshmem_lib_dir"],
            "nvshmem_transports": transports,
            "env": env,
        }
        shipped = f"NVSHMEM transports {'/'.join(transports)}" if transports else "no NVSHMEM here"
        if driver is None:
            detail = f"no NVIDIA kernel driver loaded; {shipped}"
            if not judged:
                not_judged(step, detail)
                return step
            raise StepFailed(Status.SKIP, detail, NO_DRIVER_HINT)
        driver_on = driver["EnableStreamMemOPs"] == 1 and driver["PeerMappingOverride"]
        ways = []
        if driver_on:
            ways.append("driver EnableStreamMemOPs=1 PeerMappingOverride=1")
        if facts["gdrdrv"]:
            ways.append("gdrdrv loaded (CPU-assisted IBGDA)")
        problems = []
        if not ways:
            problems.append(
                f"GPU-initiated RDMA is off: EnableStreamMemOPs={driver['EnableStreamMemOPs']}, "
                f"RegistryDwords={driver['RegistryDwords']!r}, no gdrdrv"
            )
        if env.get("NVSHMEM_REMOTE_TRANSPORT", "").lower() == "none":
            problems.append("NVSHMEM_REMOTE_TRANSPORT=none disables NVSHMEM's network transport")
        if transports and "ibgda" not in transports:
            problems.append(f"this NVSHMEM ships no IBGDA transport ({'/'.join(transports)})")
        text = "; ".join(ways) if ways else "off"
        if not judged:
            not_judged(step, f"{text}; {shipped}")
        elif problems:
            raise StepFailed(Status.FAIL, "; ".join(problems), IBGDA_HINT)
        else:
            step.detail = f"{text}; {shipped}"
            if env:
                step.detail += "; " + " ".join(f"{k}={v}" for k, v in sorted(env.items()))
    return step


def step_nccl_net(facts: dict[str, Any], judged: bool) -> Step:
    with timed_step("nccl_net") as step:
        env: dict[str, str] = facts["nccl_env"]
        plugins: list[str] = facts["nccl_net_plugins"]
        names = [d.name for d in facts["devices"]]
        step.data = {"env": env, "net_plugins": plugins, "devices": names}
        problems, hints = [], []
        net = env.get("NCCL_NET", "")
        if net.lower() == "socket":
            problems.append("NCCL_NET=Socket forces NCCL onto TCP")
            hints.append("unset NCCL_NET (or set it to IB)")
        if env.get("NCCL_IB_DISABLE", "0") not in ("", "0"):
            problems.append(f"NCCL_IB_DISABLE={env['NCCL_IB_DISABLE']} turns NCCL's IB off")
            hints.append("unset NCCL_IB_DISABLE")
        if "NCCL_IB_HCA" in env:
            chosen = fabric.hca_filter_matches(env["NCCL_IB_HCA"], names)
            step.data["ib_hca_selects"] = chosen
            if not chosen:
                problems.append(
                    f"NCCL_IB_HCA={env['NCCL_IB_HCA']} selects none of {', '.join(names) or '-'}"
                )
                hints.append("set NCCL_IB_HCA to this node's device names (or unset it)")
        plugin = env.get("NCCL_NET_PLUGIN", "")
        if plugin and plugin.lower() != "none":
            wanted = plugin if plugin.endswith(".so") else f"libnccl-net-{plugin}.so"
            if not any(Path(p).name == Path(wanted).name or p == wanted for p in plugins):
                problems.append(f"NCCL_NET_PLUGIN={plugin} but {wanted} is not on the loader path")
                hints.append(f"install {wanted} or add its directory to LD_LIBRARY_PATH")
        if not facts["libibverbs"] and not plugins:
            problems.append("no libibverbs.so.1 and no libnccl-net plugin: NCCL would use TCP")
            hints.append(VERBS_HINT)
        transport = (
            f"plugin {', '.join(plugins)}"
            if plugins
            else "built-in IB transport" + ("" if facts["libibverbs"] else " (no libibverbs)")
        )
        settings = " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "no NCCL_* settings"
        text = f"{transport}; {settings}"
        if not judged:
            not_judged(step, text)
        elif problems:
            raise StepFailed(Status.FAIL, "; ".join(problems), "; ".join(hints))
        else:
            step.detail = text
    return step


def step_backend_build(facts: dict[str, Any]) -> Step:
    """Judged on every node, NIC or not: an intranode-only build is the image's defect."""
    with timed_step("backend_build") as step:
        backend = facts["backend"]
        step.data = backend
        name = backend["backend"]
        if name is None:
            step.status, step.detail = Status.INFO, "no EP backend (deep_ep) installed here"
        elif backend["internode"] is None:
            step.status = Status.INFO
            step.detail = f"{name}: nothing to judge its internode build by"
        elif not backend["internode"]:
            raise StepFailed(
                Status.FAIL, f"{name}: " + "; ".join(backend["evidence"]), backend["hint"]
            )
        else:
            step.detail = f"{name}: " + "; ".join(backend["evidence"])
    return step


def step_affinity(facts: dict[str, Any]) -> Step:
    with timed_step("affinity") as step:
        pairs = facts["affinity"]
        step.status = Status.INFO
        step.data = {"gpus": pairs}
        if not facts["gpus"]:
            step.detail = "no NVIDIA GPU on the PCI bus"
        elif not facts["devices"]:
            step.detail = f"{len(facts['gpus'])} GPU(s), no RDMA device to pair them with"
        else:
            step.detail = ", ".join(
                f"{p['gpu']}->{'/'.join(p['nearest'])} {p['relation']}" for p in pairs
            )
    return step


def run_steps(facts: dict[str, Any]) -> list[Step]:
    """Judge every link; without an RDMA device the node's links are reported, not judged."""
    first = step_rdma_devices(facts)
    judged = first.status != Status.SKIP
    return [
        first,
        step_verbs(facts, judged),
        step_gpudirect(facts, judged),
        step_ibgda(facts, judged),
        step_nccl_net(facts, judged),
        step_backend_build(facts),
        step_affinity(facts),
    ]


def verdict(steps: list[Step], code: int) -> str:
    """One sentence for the top of the table and the JSON report."""
    if code == EXIT_OK:
        return "ready for internode EP: " + steps[0].detail
    bad = [s for s in steps if s.status in (Status.FAIL, Status.ERROR)]
    if bad:
        return "internode EP will not work here: " + "; ".join(f"{s.name}: {s.detail}" for s in bad)
    skipped = next(s for s in steps if s.status == Status.SKIP)
    return "internode EP cannot run here: " + skipped.detail


def run(args: argparse.Namespace) -> int:
    facts = collect(Path(args.root))
    steps = run_steps(facts)
    code = exit_code_of(steps, args.require)
    summary = verdict(steps, code)
    print(render_table(PROG, [f"verdict: {summary}", f"root {args.root}"], steps, code))
    if args.json:
        write_report(
            args.json,
            build_report(
                PROG,
                steps,
                code,
                verdict=summary,
                root=args.root,
                require=bool(args.require),
                kernel=facts["kernel"],
            ),
        )
    return code


def main(argv: list[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)
