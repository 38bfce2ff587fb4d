"""check_fabric.py on this machine's real /sys, and on node trees built in the kernel's layout.

Why these tests: no machine here has an RDMA NIC, so the probe's one real-world answer here is
"no RDMA device", and that path is run for real against this machine's /sys and /proc, with
the facts cross-checked against independent sources (uname, ctypes' library search, the
NVSHMEM wheel's RECORD). Everything a cluster node would show (active and dead ports, RoCE,
peermem or dma-buf, IBGDA driver settings, NCCL_IB_HCA, containers without /dev/infiniband,
GPU-NIC affinity) is read from trees laid out as the kernel lays them out
(tests/fixtures/fake_sysfs.py), through the probe's command line, so the parsing is the real
code on realistic files.
"""

from __future__ import annotations

import ctypes.util
import importlib.machinery
import importlib.metadata as metadata
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import assert_unwritable_report_is_bad_usage, run_probe_in
from fake_installs import fake_deep_ep
from fake_sysfs import PROPRIETARY_BANNER, Nic, build_node, dgx_like

from ep_image.probes import check_fabric
from ep_image.probes.check_fabric import fabric, internode

ROOT = Path(__file__).resolve().parents[1]
PROBE = "ep_image.probes.check_fabric"


#: Variables the probe reads; cleared so the caller's shell cannot change a verdict.
PROBE_ENV = set(fabric.NVSHMEM_ENV) | set(fabric.NCCL_ENV) | {"LD_LIBRARY_PATH"}


def probe_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in PROBE_ENV}
    env.update(extra)
    return env


def run_fabric(
    tmp_path: Path, *args: str, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], dict | None]:
    run = run_probe_in(
        tmp_path, "check_fabric.py", *args, env=env if env is not None else probe_env(), timeout=120
    )
    return run.proc, run.report


def statuses(report: dict) -> dict[str, str]:
    return {s["name"]: s["status"] for s in report["steps"]}


def step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


@pytest.fixture()
def verbs_libs(tmp_path: Path) -> dict[str, str]:
    """A loader path holding the verbs libraries' names, as an image with rdma-core has.

    The probe only looks libraries up (it never loads them), so a directory on
    LD_LIBRARY_PATH with these names is what it must find, whatever this machine holds.
    """
    lib = tmp_path / "rdma-core-lib"
    lib.mkdir()
    for name in ("libibverbs.so.1", "libmlx5.so.1"):
        (lib / name).write_bytes(b"\x7fELF")
    return probe_env(LD_LIBRARY_PATH=str(lib))


# ---------------------------------------------------------------------------------------
# This machine, for real: no RDMA device
# ---------------------------------------------------------------------------------------


def real_rdma_devices() -> list[str]:
    try:
        return sorted(os.listdir("/sys/class/infiniband"))
    except OSError:
        return []


def test_this_machine_real_sys(tmp_path: Path) -> None:
    proc, report = run_fabric(tmp_path)
    assert report is not None, proc.stderr
    assert report["probe"] == "check_fabric" and report["schema_version"] == 1
    assert list(statuses(report)) == list(check_fabric.STEP_NAMES)
    devices = step(report, "rdma_devices")["data"]["devices"]
    assert [d["name"] for d in devices] == real_rdma_devices()
    assert report["kernel"] == os.uname().release
    peermem = step(report, "gpudirect_rdma")["data"]["nvidia_peermem"]
    assert peermem == os.path.isdir("/sys/module/nvidia_peermem")
    # The probe's own library search agrees with ctypes' (ldconfig/gcc based) one.
    assert bool(step(report, "verbs")["data"]["libibverbs"]) == bool(
        ctypes.util.find_library("ibverbs")
    )
    if real_rdma_devices():
        pytest.skip("this machine has RDMA devices: the no-RDMA path is not what it shows")
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert report["exit_code"] == 5 and report["result"] == "skipped"
    assert statuses(report)["rdma_devices"] == "skip"
    assert report["verdict"].startswith("internode EP cannot run here: no RDMA device")
    assert "verdict: internode EP cannot run here: no RDMA device" in proc.stdout
    assert "fix: internode EP needs an RDMA NIC" in proc.stdout
    assert "result: skipped (exit 5)" in proc.stdout
    # Without a NIC nothing else is judged, only reported.
    assert {statuses(report)[n] for n in check_fabric.STEP_NAMES[1:]} == {"info"}
    assert "Traceback" not in proc.stderr


def test_this_machine_require_turns_skip_into_failure(tmp_path: Path) -> None:
    if real_rdma_devices():
        pytest.skip("this machine has RDMA devices")
    proc, report = run_fabric(tmp_path, "--require")
    assert proc.returncode == 1 and report["exit_code"] == 1, proc.stdout
    assert report["require"] is True
    assert "result: failed (exit 1)" in proc.stdout


def test_nvshmem_transports_are_the_wheels(tmp_path: Path) -> None:
    """What the probe lists is what the installed nvidia-nvshmem wheel's RECORD says."""
    try:
        files = metadata.files("nvidia-nvshmem-cu13") or []
    except metadata.PackageNotFoundError:
        pytest.skip("no nvidia-nvshmem-cu13 in this environment")
    expected = sorted(
        {
            Path(str(f)).name.split(".so")[0].removeprefix("nvshmem_transport_")
            for f in files
            if Path(str(f)).name.startswith("nvshmem_transport_")
        }
    )
    _, report = run_fabric(tmp_path)
    assert step(report, "ibgda")["data"]["nvshmem_transports"] == expected
    assert "ibgda" in expected  # DeepEP v1 needs it; the pinned wheel ships it


# ---------------------------------------------------------------------------------------
# Node trees in the kernel's layout
# ---------------------------------------------------------------------------------------


def test_healthy_ib_node_is_ready(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    node = dgx_like(tmp_path / "node")
    proc, report = run_fabric(tmp_path, "--root", str(node), "--require", env=verbs_libs)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert set(statuses(report).values()) <= {"pass", "info"}
    rdma = step(report, "rdma_devices")
    assert rdma["detail"] == (
        "2 device(s), 2 active port(s): mlx5_0/1 IB 400 Gb/sec (4X NDR), "
        "mlx5_1/1 IB 400 Gb/sec (4X NDR)"
    )
    dev0 = rdma["data"]["devices"][0]
    assert dev0["pci"] == "0000:19:00.0" and dev0["numa_node"] == 0
    assert dev0["pci_chain"][0] == "pci0000:15"
    port = dev0["ports"][0]
    assert (port["state_code"], port["state"], port["phys_state"]) == (4, "ACTIVE", "LinkUp")
    assert port["rate_gbps"] == 400.0 and port["active"] is True
    assert step(report, "verbs")["detail"].endswith("mlx5_0=uverbs0, mlx5_1=uverbs1")
    gd = step(report, "gpudirect_rdma")
    assert "driver 580.95.05 (open)" in gd["detail"] and "nvidia-peermem loaded" in gd["detail"]
    assert "dma-buf (kernel 6.8.0-45-generic" in gd["detail"]
    assert step(report, "ibgda")["data"]["EnableStreamMemOPs"] == 1
    # Each GPU's nearest NIC is the one behind its own PCIe switch.
    pairs = step(report, "affinity")["data"]["gpus"]
    assert [(p["gpu"], p["nearest"], p["relation"]) for p in pairs] == [
        ("0000:18:00.0", ["mlx5_0"], "PXB"),
        ("0000:9a:00.0", ["mlx5_1"], "PXB"),
    ]
    assert report["verdict"].startswith("ready for internode EP: 2 device(s)")
    assert "result: passed (exit 0)" in proc.stdout


def test_healthy_node_verbs_verdict_follows_this_machines_loader(tmp_path: Path) -> None:
    """Without a stand-in library path the answer is this machine's own libibverbs."""
    node = dgx_like(tmp_path / "node")
    _, report = run_fabric(tmp_path, "--root", str(node))
    have = bool(ctypes.util.find_library("ibverbs")) and bool(ctypes.util.find_library("mlx5"))
    assert statuses(report)["verbs"] == ("pass" if have else "fail")
    if not have:
        assert "fix: install rdma-core's user space" in step_text(report, "verbs")


def step_text(report: dict, name: str) -> str:
    s = step(report, name)
    return f"{s['detail']} fix: {s['hint']}"


def test_roce_ports_down_fail_with_the_fix(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    sw = ["pci0000:00", "0000:00:02.0"]
    nics = [
        Nic(
            "mlx5_0",
            [*sw, "0000:03:00.0"],
            state="1: DOWN",
            phys_state="3: Disabled",
            link_layer="Ethernet",
            rate="40 Gb/sec (4X QDR)",
            netdev="enp3s0f0np0",
        )
    ]
    node = build_node(tmp_path / "node", nics, [])
    proc, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    assert proc.returncode == 1
    rdma = step(report, "rdma_devices")
    assert rdma["status"] == "fail"
    assert rdma["detail"] == "1 RDMA device(s), no ACTIVE port: mlx5_0/1 DOWN (Disabled)"
    assert "subnet manager" in rdma["hint"] and "ip link set" in rdma["hint"]
    dev = rdma["data"]["devices"][0]
    assert dev["netdevs"] == ["enp3s0f0np0"]
    assert dev["ports"][0]["link_layer"] == "Ethernet"
    assert report["verdict"].startswith("internode EP will not work here: rdma_devices:")
    assert "fix: no port is ACTIVE/LinkUp" in proc.stdout


def test_roce_active_port_is_named_roce(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    nics = [
        Nic(
            "mlx5_0",
            ["pci0000:00", "0000:00:02.0", "0000:03:00.0"],
            link_layer="Ethernet",
            rate="200 Gb/sec (4X HDR)",
            netdev="eth2",
        )
    ]
    node = build_node(tmp_path / "node", nics, [])
    _, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    rdma = step(report, "rdma_devices")
    assert rdma["status"] == "pass"
    assert rdma["detail"].endswith("mlx5_0/1 RoCE 200 Gb/sec (4X HDR)")
    assert rdma["data"]["link_layers"] == ["Ethernet"]


@pytest.mark.parametrize(
    ("driver", "modules", "kernel", "status", "phrase"),
    [
        (None, ("nvidia_peermem",), "6.8.0", "pass", "nvidia-peermem loaded"),
        (None, ("nvidia",), "6.8.0", "pass", "dma-buf (kernel 6.8.0, open kernel modules)"),
        (None, ("nvidia",), "5.4.0-216-generic", "fail", "dma-buf not possible"),
        (PROPRIETARY_BANNER, ("nvidia",), "6.8.0", "fail", "(proprietary kernel modules)"),
        (PROPRIETARY_BANNER, ("nvidia_peermem",), "6.8.0", "pass", "(proprietary), kernel"),
    ],
)
def test_gpudirect_rdma_peermem_or_dmabuf(
    tmp_path: Path,
    verbs_libs: dict[str, str],
    driver: str | None,
    modules: tuple[str, ...],
    kernel: str,
    status: str,
    phrase: str,
) -> None:
    kwargs = {"driver": driver} if driver else {}
    node = dgx_like(tmp_path / "node", modules=modules, kernel=kernel, **kwargs)
    proc, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    gd = step(report, "gpudirect_rdma")
    assert gd["status"] == status, gd
    assert phrase in gd["detail"]
    if status == "fail":
        assert proc.returncode == 1
        assert "modprobe nvidia-peermem" in gd["hint"]


def test_ibgda_off_fails_naming_the_driver_settings(
    tmp_path: Path, verbs_libs: dict[str, str]
) -> None:
    node = dgx_like(tmp_path / "node", stream_mem_ops=0, registry_dwords="")
    proc, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    assert proc.returncode == 1
    ib = step(report, "ibgda")
    assert ib["status"] == "fail"
    assert "EnableStreamMemOPs=0, RegistryDwords=''" in ib["detail"]
    assert "NVreg_EnableStreamMemOPs=1" in ib["hint"] and "gdrdrv" in ib["hint"]
    assert ib["data"]["PeerMappingOverride"] is False


def test_ibgda_through_gdrdrv_passes(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    node = dgx_like(
        tmp_path / "node",
        stream_mem_ops=0,
        registry_dwords="",
        modules=("nvidia", "nvidia_peermem", "gdrdrv"),
    )
    _, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    ib = step(report, "ibgda")
    assert ib["status"] == "pass" and "gdrdrv loaded (CPU-assisted IBGDA)" in ib["detail"]


def test_nvshmem_without_ibgda_transport_or_with_transport_none(
    tmp_path: Path, verbs_libs: dict[str, str]
) -> None:
    nvshmem = tmp_path / "nvshmem"
    (nvshmem / "lib").mkdir(parents=True)
    (nvshmem / "lib" / "nvshmem_transport_ibrc.so.3").write_bytes(b"\x7fELF")
    node = dgx_like(tmp_path / "node")
    env = dict(verbs_libs, NVSHMEM_DIR=str(nvshmem), NVSHMEM_REMOTE_TRANSPORT="none")
    proc, report = run_fabric(tmp_path, "--root", str(node), env=env)
    ib = step(report, "ibgda")
    assert proc.returncode == 1 and ib["status"] == "fail"
    assert "NVSHMEM_REMOTE_TRANSPORT=none" in ib["detail"]
    assert "ships no IBGDA transport (ibrc)" in ib["detail"]
    assert ib["data"]["env"]["NVSHMEM_DIR"] == str(nvshmem)


@pytest.mark.parametrize(
    ("settings", "status", "selects"),
    [
        ({"NCCL_IB_HCA": "mlx5_9"}, "fail", []),
        ({"NCCL_IB_HCA": "=mlx5_1:1"}, "pass", ["mlx5_1"]),
        ({"NCCL_IB_HCA": "^=mlx5_0"}, "pass", ["mlx5_1"]),
        ({"NCCL_IB_HCA": "mlx5"}, "pass", ["mlx5_0", "mlx5_1"]),
        ({"NCCL_NET": "Socket"}, "fail", None),
        ({"NCCL_IB_DISABLE": "1"}, "fail", None),
        ({"NCCL_NET_PLUGIN": "aws-ofi"}, "fail", None),
    ],
)
def test_nccl_settings_are_checked_against_the_devices(
    tmp_path: Path,
    verbs_libs: dict[str, str],
    settings: dict[str, str],
    status: str,
    selects: list[str] | None,
) -> None:
    node = dgx_like(tmp_path / "node")
    _, report = run_fabric(tmp_path, "--root", str(node), env=dict(verbs_libs, **settings))
    nccl = step(report, "nccl_net")
    assert nccl["status"] == status, nccl
    assert nccl["data"]["env"] == settings
    if selects is not None:
        assert nccl["data"]["ib_hca_selects"] == selects
    if status == "fail":
        assert nccl["hint"]


def test_nccl_net_plugin_found_on_the_loader_path(tmp_path: Path) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    for name in ("libibverbs.so.1", "libmlx5.so.1", "libnccl-net-aws-ofi.so"):
        (lib / name).write_bytes(b"\x7fELF")
    node = dgx_like(tmp_path / "node")
    env = probe_env(LD_LIBRARY_PATH=str(lib), NCCL_NET_PLUGIN="aws-ofi")
    _, report = run_fabric(tmp_path, "--root", str(node), env=env)
    nccl = step(report, "nccl_net")
    assert nccl["status"] == "pass"
    assert nccl["data"]["net_plugins"][0] == str(lib / "libnccl-net-aws-ofi.so")


def test_container_without_dev_infiniband(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    sw = ["pci0000:15", "0000:15:01.0", "0000:16:00.0"]
    nics = [Nic("mlx5_0", [*sw, "0000:17:01.0", "0000:19:00.0"], uverbs_node=False)]
    node = build_node(tmp_path / "node", nics, [])
    proc, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    verbs = step(report, "verbs")
    assert proc.returncode == 1 and verbs["status"] == "fail"
    assert "no /dev/infiniband/uverbs node for mlx5_0" in verbs["detail"]
    assert "--device /dev/infiniband" in verbs["hint"]


def test_empty_infiniband_class_is_no_rdma_device(tmp_path: Path) -> None:
    """ib_core loaded, no HCA: the directory exists and is empty."""
    node = build_node(tmp_path / "node", [], [])
    assert (node / "sys" / "class" / "infiniband").is_dir()
    proc, report = run_fabric(tmp_path, "--root", str(node))
    assert proc.returncode == 5
    assert step(report, "rdma_devices")["detail"] == (
        f"no RDMA device ({node}/sys/class/infiniband is absent or empty)"
    )
    gd = step(report, "gpudirect_rdma")
    assert gd["status"] == "info" and "not judged: no RDMA device" in gd["detail"]


def test_rdma_without_nvidia_driver_cannot_run(tmp_path: Path, verbs_libs: dict[str, str]) -> None:
    node = dgx_like(tmp_path / "node", driver=None, modules=("ib_core",))
    proc, report = run_fabric(tmp_path, "--root", str(node), env=verbs_libs)
    assert proc.returncode == 5
    assert statuses(report)["gpudirect_rdma"] == "skip"
    assert statuses(report)["rdma_devices"] == "pass"
    assert report["verdict"] == "internode EP cannot run here: no NVIDIA kernel driver loaded"


def test_an_unwritable_report_path_is_bad_usage(tmp_path: Path) -> None:
    assert_unwritable_report_is_bad_usage(tmp_path, "check_fabric")


def test_bad_usage_is_one_line_exit_2(tmp_path: Path) -> None:
    proc, report = run_fabric(tmp_path, "--root", str(tmp_path / "absent"))
    assert proc.returncode == 2 and report is None
    assert (
        proc.stderr.strip()
        == f"check_fabric: usage error: --root {tmp_path / 'absent'}: not a directory"
    )
    proc, _ = run_fabric(tmp_path, "--nope")
    assert proc.returncode == 2
    assert proc.stderr.startswith("check_fabric: usage error: unrecognized arguments: --nope")


def test_help_reads_like_the_docs() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", PROBE, "--help"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0
    for phrase in ("internode expert parallelism", "--require", "--root DIR", "exit codes:"):
        assert phrase in proc.stdout


# ---------------------------------------------------------------------------------------
# Parsers, on the kernel's exact strings
# ---------------------------------------------------------------------------------------


def test_port_state_and_rate_parsing() -> None:
    assert fabric.parse_state("4: ACTIVE") == (4, "ACTIVE")
    assert fabric.parse_state("5: LinkUp") == (5, "LinkUp")
    assert fabric.parse_state("2: Polling") == (2, "Polling")
    assert fabric.parse_state(None) == (None, None)
    assert fabric.parse_rate("400 Gb/sec (4X NDR)") == 400.0
    assert fabric.parse_rate("2.5 Gb/sec (1X SDR)") == 2.5
    assert fabric.parse_rate("garbage") is None


def test_pci_relations() -> None:
    sw = ["pci0000:15", "0000:15:01.0", "0000:16:00.0"]
    gpu = [*sw, "0000:17:00.0", "0000:18:00.0"]
    assert fabric.relation(gpu, [*sw, "0000:17:01.0", "0000:19:00.0"], 0, 0) == "PXB"
    assert fabric.relation(gpu, [*sw, "0000:17:00.0", "0000:18:00.1"], 0, 0) == "PIX"
    assert fabric.relation(gpu, ["pci0000:15", "0000:15:02.0", "0000:20:00.0"], 0, 0) == "PHB"
    assert fabric.relation(gpu, ["pci0000:40", "0000:40:01.0", "0000:41:00.0"], 0, 0) == "NODE"
    assert fabric.relation(gpu, ["pci0000:97", "0000:97:01.0", "0000:98:00.0"], 0, 1) == "SYS"


# ---------------------------------------------------------------------------------------
# backend_build: the installed backend's internode build, from real ELF files
# ---------------------------------------------------------------------------------------

needs_cc = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler to link .so files")
needs_verbs_dev = pytest.mark.skipif(
    not Path("/usr/include/infiniband/verbs.h").exists(),
    reason="needs libibverbs-dev to link against libibverbs/libmlx5 (.ci/run installs it)",
)


def link_extension(site: Path, module: str, *link_args: str) -> Path:
    """A real shared object named as a CPython extension, linked as setup.py links it."""
    src = site / f"{module}.c"
    src.write_text("int deep_ep_probe_marker(void) { return 0; }\n")
    out = site / f"{module}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-o", str(out), str(src), "-Wl,--no-as-needed", *link_args],
        check=True,
        capture_output=True,
        timeout=120,
    )
    return out


def backend_step(tmp_path: Path, site: Path, **env: str) -> tuple[int, dict]:
    proc, report = run_fabric(tmp_path, env=probe_env(PYTHONPATH=str(site), **env))
    assert report is not None, proc.stderr
    return proc.returncode, step(report, "backend_build")


@needs_cc
def test_hybridep_built_intranode_only_fails_naming_the_rebuild(tmp_path: Path) -> None:
    site = fake_deep_ep(
        tmp_path / "site", "deep-ep", "1.2.1+e0a5b1d", ["buffer.py", "hybrid_ep_buffer.py"], ""
    )
    link_extension(site, "hybrid_ep_cpp")
    code, s = backend_step(tmp_path, site)
    assert s["status"] == "fail" and code == 1
    assert s["data"]["backend"] == "hybridep" and s["data"]["internode"] is False
    assert "built without HYBRID_EP_MULTINODE" in s["detail"]
    assert "uv cache clean deep-ep" in s["hint"]


@needs_cc
@needs_verbs_dev
def test_hybridep_built_multinode_passes(tmp_path: Path) -> None:
    site = fake_deep_ep(
        tmp_path / "site",
        "deep-ep",
        "1.2.1+e0a5b1d",
        ["buffer.py", "hybrid_ep_buffer.py", "backend/nccl/obj/doca_gpunetio.o"],
        "",
    )
    link_extension(site, "hybrid_ep_cpp", "-lmlx5", "-libverbs")
    code, s = backend_step(tmp_path, site)
    assert s["status"] == "pass", s
    assert s["data"]["path"] == "doca" and s["data"]["doca_objects"] is True
    assert {"libibverbs.so.1", "libmlx5.so.1"} <= set(s["data"]["needed"])
    assert s["detail"] == "hybridep: hybrid_ep_cpp links libibverbs + libmlx5, DOCA objects shipped"
    assert code == 5  # this machine still has no RDMA device


@needs_cc
@pytest.mark.parametrize("with_nvshmem", [True, False])
def test_deepep_v1_internode_kernels_follow_nvshmem_linkage(
    tmp_path: Path, with_nvshmem: bool
) -> None:
    site = fake_deep_ep(tmp_path / "site", "tokenspeed-deepep", "1.2.1", ["buffer.py"], "")
    args: list[str] = []
    if with_nvshmem:
        lib = fabric.nvshmem_lib_dir()
        if lib is None:
            pytest.skip("no NVSHMEM wheel here to link against")
        args = [f"-L{lib}", "-l:libnvshmem_host.so.3"]
    link_extension(site, "deep_ep_cpp", *args)
    code, s = backend_step(tmp_path, site)
    assert s["data"]["backend"] == "deepep_v1"
    assert s["status"] == ("pass" if with_nvshmem else "fail"), s
    if not with_nvshmem:
        assert "built without NVSHMEM" in s["detail"] and code == 1


def test_deepep_v2_needs_nccl_with_gin(tmp_path: Path) -> None:
    site = fake_deep_ep(tmp_path / "site", "sgl-deep-ep", "0.1.2.post1", ["buffers/elastic.py"], "")
    nccl = metadata.version("nvidia-nccl-cu13")
    _, s = backend_step(tmp_path, site)
    assert s["data"]["nccl"] == nccl
    assert s["status"] == "pass" and f"NCCL wheel {nccl} >= 2.30.4" in s["detail"]
    # An older NCCL wheel first on the path, as a torch pin that lowered NCCL would leave it.
    old = site / "nvidia_nccl_cu13-2.28.9.dist-info"
    old.mkdir()
    (old / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: nvidia-nccl-cu13\nVersion: 2.28.9\n"
    )
    code, s = backend_step(tmp_path, site)
    assert s["status"] == "fail" and code == 1
    assert "NCCL wheel 2.28.9 < 2.30.4" in s["detail"] and "nvidia-nccl-cu13>=2.30.4" in s["hint"]


def test_elf_needed_matches_readelf() -> None:
    """The probe's DT_NEEDED reader against binutils, on real binaries of this machine."""
    if shutil.which("readelf") is None:
        pytest.skip("no readelf")
    files = [os.path.realpath(sys.executable)]
    files += [p for p in fabric.find_libraries(r"^libibverbs\.so\.1$")[:1]]
    lib = fabric.nvshmem_lib_dir()
    if lib:
        files.append(os.path.join(lib, "libnvshmem_host.so.3"))
    for path in files:
        out = subprocess.run(["readelf", "-d", path], capture_output=True, text=True).stdout
        expected = [ln.split("[", 1)[1].rstrip("]") for ln in out.splitlines() if "(NEEDED)" in ln]
        assert expected, path
        assert internode.elf_needed(path) == expected, path
    assert internode.elf_needed(__file__) is None  # not an ELF file
