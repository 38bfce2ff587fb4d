"""The gates every rank probe runs first: the steps that must pass before any check or training
drives the backend (import, prerequisites, buffer).

Why this module exists: a backend that does not import, cannot run here or cannot build its
buffer gets a verdict that names the fix (missing 4, unusable 3, skipped 5) instead of a
failed check; each gate gathers all its facts first, so the report shows them even when one
problem ends the step.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ep_image.files import trust
from ep_image.probes import _backend_detect, _cuda, _installed, _mapped, _torch_stack, _versions
from ep_image.probes._adapters.base import EPBackend, Shape
from ep_image.probes._ranks.runtime import Runtime, agree, sync
from ep_image.probes._ranks.types import Selection
from ep_image.probes._report import Status, Step, StepFailed, timed_step


def step_import(rt: Runtime, sel: Selection, backend: EPBackend) -> Step:
    """Find, trial-import (in a child process) and import the backend; report its identity."""
    import torch

    with timed_step("import") as step:
        data: dict[str, Any] = {"backend": sel.name, "how": sel.how}
        data["torch"] = torch.__version__
        data["torch_cuda"] = torch.version.cuda
        cuda_major = int(torch.version.cuda.split(".")[0]) if torch.version.cuda else None
        data["cuda_major"] = cuda_major
        inst = sel.installed
        if inst is not None and inst.module_dir is not None and sel.name != "torch":
            data.update(
                module_dir=inst.module_dir,
                distribution=inst.distribution,
                version=inst.version,
                commit=inst.commit,
                commit_source=inst.commit_source,
                upstream=inst.upstream,
                build_info=inst.build_info,
            )
            expected_major = inst.build_info.get("EXPECTED_CUDA_MAJOR")
            if (
                expected_major is not None
                and cuda_major is not None
                and expected_major != cuda_major
            ):
                raise StepFailed(
                    Status.ERROR,
                    f"{inst.distribution} {inst.version} is built for CUDA {expected_major}, "
                    f"torch uses CUDA {cuda_major}",
                    "install the torch build for the backend's CUDA (cu130 for the pinned wheels)",
                    data,
                )
            if rt.env.local_rank == 0:
                trial = _backend_detect.trial_import(inst.module, timeout=rt.timeout * 0.8)
                if not trial.ok:
                    status, detail, hint = _backend_detect.classify_import_failure(
                        sel.name,
                        trial.output,
                        trial.returncode,
                        torch.cuda.is_available(),
                        inst.module,
                    )
                    data["import_output_tail"] = trial.output[-2000:]
                    raise StepFailed(status, detail, hint, data)
        step.data = data
    merged = agree(rt, step)
    if merged.status != Status.PASS:
        return merged

    # Every rank imports in-process only after the trial import passed everywhere.
    with timed_step("import") as step:
        step.data = dict(merged.data)
        step.data.pop("ranks", None)
        step.data.update(backend.load())
        step.detail = _import_detail(sel, step.data)
    return agree(rt, step)


def _import_detail(sel: Selection, data: dict[str, Any]) -> str:
    if sel.name == "torch":
        return f"built-in all_gather reference backend; torch {data['torch']}"
    if sel.custom:
        return f"{sel.how}; torch {data['torch']}"
    parts = [f"{data.get('distribution')} {data.get('version')}"]
    if data.get("commit"):
        parts.append(f"commit {data['commit']}")
    elif data.get("commit_source"):
        parts.append(f"commit {data['commit_source']}")
    if data.get("upstream"):
        parts.append(f"from {data['upstream']}")
    parts.append(f"at {data.get('module_path') or data.get('module_dir')}")
    if data.get("build_info"):
        parts.append("build " + ", ".join(f"{k}={v}" for k, v in data["build_info"].items()))
    parts.append(f"CUDA {data.get('torch_cuda')}")
    if "jit_cache_dir" in data:
        files = data["jit_cache_files_before"]
        parts.append(
            f"JIT cache {data['jit_cache_dir']} "
            + (f"({files} files: reused)" if files else "(empty: the first dispatch compiles)")
        )
        parts.append(f"NCCL GIN {data['gin']}")
    return "; ".join(parts)


Problems = list[tuple[Status, str, str]]


def step_prerequisites(rt: Runtime, backend: EPBackend) -> Step:
    """GPU placement, world size, CUDA home and the tools JIT backends run from it, NCCL and
    NVSHMEM, and what the backend itself names (``EPBackend.prerequisites``: NCCL EP's JIT
    compiler and headers).

    Every fact is gathered first, so the report shows all of them even when one problem
    ends the step; the most severe problem decides its status.
    """
    with timed_step("prerequisites") as step:
        data: dict[str, Any] = {"world_size": rt.env.world, "nodes": rt.env.nodes}
        notes: list[str] = []
        problems: Problems = []
        _check_gpus(rt, backend, data, notes, problems)
        why_not = backend.unsupported(rt.env.world, rt.env.local_world)
        if why_not is not None:
            where = f"{rt.env.world} rank(s)"
            if rt.env.nodes > 1:
                where += f" on {rt.env.nodes} nodes x {rt.env.local_world}"
            problems.append((Status.SKIP, f"{backend.name} cannot run on {where}", why_not))
        if backend.jit_compiles:
            _check_cuda_home(backend, data, notes, problems)
        _check_jit_cache(backend, data, notes, problems)
        _check_nccl(rt, backend, data, notes, problems)
        _check_backend(backend, data, notes, problems)
        _report_nvshmem(backend, data, notes)
        _report_cxx_runtime(backend, data, notes)
        step.data = data
        step.detail = "; ".join(notes)
        if problems:
            status, detail, hint = max(problems, key=lambda p: p[0].severity)
            raise StepFailed(status, detail + " (" + step.detail + ")", hint, data)
    return agree(rt, step)


def _check_gpus(
    rt: Runtime, backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    import torch

    place = rt.placement
    data["gpus_visible"] = place.gpus
    data["ranks_per_gpu"] = place.ranks_per_gpu
    data["shared_gpu"] = place.shared
    if place.problem is not None:
        problems.append((Status.SKIP, *place.problem))
        return
    if not (backend.requires_gpu or rt.use_gpu):
        notes.append("CPU over gloo (no GPU needed)")
        return
    if place.gpus == 0:
        problems.append(
            (
                Status.SKIP,
                f"{backend.name} needs a GPU and none is visible",
                "no GPU visible: run on a GPU node or pass --backend torch",
            )
        )
        notes.append("no GPU")
        return
    data["gpu"] = torch.cuda.get_device_name(rt.device)
    data["device"] = str(rt.device)
    text = f"{place.gpus}x {data['gpu']}"
    if place.shared:
        text += (
            f"; {rt.env.local_world} local ranks share them ({place.ranks_per_gpu}/GPU max, "
            f"{place.group_backend} group): functional check, bandwidth is not a link figure"
        )
    notes.append(text)


def _check_jit_cache(
    backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    """A JIT cache the backend loads kernels from must be nobody else's to write, inside as well
    as itself: otherwise whoever can write it, or a kernel in it, runs code in this job (and in
    every job that uses it)."""
    where = backend.jit_cache_dir()
    if where is None:
        return
    why = trust.untrusted_cache(where)
    if why is None and where.is_dir():
        inside = trust.untrusted_inside(where)
        why = inside.why
        data["jit_cache_entries_checked"] = inside.entries
        if not inside.complete:
            notes.append(
                f"JIT cache {where}: only its first {inside.entries} entries checked for "
                "owners and write bits (a bigger cache is not walked whole)"
            )
    data["jit_cache_trusted"] = why is None
    if why is not None:
        problems.append(
            (
                Status.ERROR,
                f"{backend.name} loads its JIT kernels from {where}, and {why}: kernels planted "
                "there would run in this job",
                "chown the path named to this user (or root) and chmod go-w it, or remove it "
                f"(its kernels are compiled again), or point {backend.jit_cache_variable} at a "
                "directory only you (or root) can write",
            )
        )


#: Where to get a JIT tool a CUDA home lacks, beside a full toolkit (see _check_cuda_home).
_TOOL_SOURCES = {
    "cuobjdump": "NVIDIA's nvidia-cuda-cuobjdump wheel has it for CUDA 13 (13.2.51 is the oldest "
    "cu13 release on PyPI), as nvidia/cu13/bin/cuobjdump: copy that into {bin}",
}


def _check_cuda_home(
    backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    """The CUDA home the backend's JIT uses, and every tool it runs from its bin/.

    A JIT backend runs its tools by path, ``$CUDA_HOME/bin/<tool>`` (``jit_tools``), not from
    PATH: a home missing one passed here and failed at the first dispatch (DeepEP v2 without
    cuobjdump: ``kernel_runtime.hpp:33): exit_code == 0``), so each is looked for there.
    """
    home, how = _cuda.cuda_home()
    nvcc, nvcc_ver = _cuda.nvcc_version(home)
    data.update(cuda_home=home, cuda_home_from=how, nvcc=nvcc, nvcc_version=nvcc_ver)
    tools = backend.jit_tools
    runs = _and(f"$CUDA_HOME/bin/{tool}" for tool in tools)
    why = f"{backend.name} JIT-compiles its kernels at run time and runs {runs}"
    if home is None:
        data["jit_tools"] = dict.fromkeys(tools)
        problems.append(
            (
                Status.ERROR,
                "CUDA home not found",
                f"set CUDA_HOME to a CUDA 13 devel toolkit (it has {_and(tools)}); {why}",
            )
        )
        notes.append("no CUDA home")
        return
    bin_dir = Path(home) / "bin"
    found = {tool: _executable(bin_dir / tool) for tool in tools}
    data["jit_tools"] = found
    missing = [tool for tool, path in found.items() if path is None]
    if found.get("nvcc") is not None and nvcc != found["nvcc"]:
        nvcc_ver = None  # the version read was another nvcc's (on PATH), or none
        problems.append(
            (
                Status.ERROR,
                f"{found['nvcc']} --version names no CUDA release",
                f"set CUDA_HOME to a CUDA 13 devel toolkit whose bin/nvcc runs; {why}",
            )
        )
    if missing:
        fixes = [
            f"install a CUDA 13 devel toolkit at {home} (it has {_and(tools)}) or set "
            "CUDA_HOME to such a full toolkit"
        ]
        fixes += [
            _TOOL_SOURCES[tool].format(bin=bin_dir) for tool in missing if tool in _TOOL_SOURCES
        ]
        problems.append(
            (
                Status.ERROR,
                f"CUDA home {home} ({how}) has no "
                + ", no ".join(str(bin_dir / tool) for tool in missing),
                "; ".join(fixes) + f"; {why}",
            )
        )
    if not (Path(home) / "include" / "cuda_runtime.h").is_file():
        problems.append(
            (
                Status.ERROR,
                f"CUDA home {home} ({how}) has no include/cuda_runtime.h",
                "set CUDA_HOME to the CUDA 13 toolkit root (the directory holding bin/nvcc "
                f"and include/); {why}",
            )
        )
    have = [
        f"nvcc {nvcc_ver}" if tool == "nvcc" and nvcc_ver else tool
        for tool, path in found.items()
        if path is not None
    ]
    text = f"CUDA home {home}"
    if have:
        text += f" ({', '.join(have)})"
    if missing:
        text += f", no {', no '.join(missing)}"
    notes.append(text)


def _and(words: Iterable[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    items = list(words)
    return ", ".join(items[:-1]) + " and " + items[-1] if len(items) > 1 else "".join(items)


def _executable(path: Path) -> str | None:
    """``path`` as a string when it is an executable file, else None."""
    return str(path) if path.is_file() and os.access(path, os.X_OK) else None


def _check_nccl(
    rt: Runtime, backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    nccl = _torch_stack.torch_facts()["nccl"] if rt.use_gpu else None
    nccl_dist = _installed.dist_version("nvidia-nccl-cu13", "nvidia-nccl-cu12")
    data["nccl"] = nccl
    data["nccl_dist"] = f"{nccl_dist[0]} {nccl_dist[1]}" if nccl_dist else None
    data["nccl_mapped"] = _mapped.mapped_libraries(r"^libnccl")
    if nccl:
        notes.append(f"NCCL {nccl}")
    if backend.min_nccl is not None and _versions.version_at_least(nccl, backend.min_nccl) is False:
        need = ".".join(map(str, backend.min_nccl))
        problems.append(
            (
                Status.ERROR,
                f"NCCL {nccl} loaded, {backend.name} needs >= {need}",
                _backend_detect.NCCL_FIX,
            )
        )


def _check_backend(
    backend: EPBackend, data: dict[str, Any], notes: list[str], problems: Problems
) -> None:
    """The backend's own prerequisites (``EPBackend.prerequisites``), after the common ones."""
    if not backend.requires_gpu:
        return
    facts, own = backend.prerequisites()
    data.update(facts)
    problems.extend(own)
    if own:
        notes.append(f"{len(own)} {backend.name} prerequisite(s) not met")


def _report_nvshmem(backend: EPBackend, data: dict[str, Any], notes: list[str]) -> None:
    """NVSHMEM is reported, not required: the intranode paths checked here do not use it.

    DeepEP v1 (and the hybrid-ep branch's v1 kernels) silently build without NVSHMEM when
    neither NVSHMEM_DIR nor the nvidia-nvshmem wheel was there at build time, which disables
    their internode and low-latency kernels; whether the extension links libnvshmem_host
    tells which build this is.
    """
    nvshmem = _installed.dist_version("nvidia-nvshmem-cu13", "nvidia-nvshmem-cu12")
    data["nvshmem_dist"] = f"{nvshmem[0]} {nvshmem[1]}" if nvshmem else None
    data["nvshmem_dir"] = os.environ.get("NVSHMEM_DIR")
    data["nvshmem_mapped"] = _mapped.mapped_libraries(r"^libnvshmem")
    if not backend.requires_gpu:
        return
    found = nvshmem[1] if nvshmem else data["nvshmem_dir"]
    text = f"NVSHMEM {found}" if found else "NVSHMEM not found"
    links = (
        backend.name in _backend_detect.BACKEND_NAMES
        and _backend_detect.registry.spec(backend.name).links_nvshmem
    )
    extension = _installed.extension_path("deep_ep_cpp") if links else None
    if extension:
        linked = _installed.file_contains(extension, b"libnvshmem_host")
        data["nvshmem_linked_by"] = extension if linked else None
        text += (
            ", linked by deep_ep_cpp"
            if linked
            else ", not linked by deep_ep_cpp (built without it: internode and low-latency "
            "kernels disabled)"
        )
    notes.append(text)


#: Compiled extension modules the backends ship, top-level or inside ``deep_ep``.
_EXTENSIONS = ("deep_ep_cpp", "hybrid_ep_cpp", "deep_ep._C")


def _report_cxx_runtime(backend: EPBackend, data: dict[str, Any], notes: list[str]) -> None:
    """Name extensions that carry their own libstdc++ (a known cause of native crashes)."""
    if not backend.requires_gpu:
        return
    static = [
        path
        for path in filter(None, (_installed.extension_path(name) for name in _EXTENSIONS))
        if _installed.static_cxx_runtime(path)
    ]
    data["static_libstdcxx"] = static
    if static:
        notes.append(
            f"{', '.join(Path(p).name for p in static)} carries its own libstdc++ (built with "
            "-static-libstdc++): a second C++ runtime beside torch's; rebuild with the system "
            "g++ if it crashes"
        )


def step_buffer(rt: Runtime, backend: EPBackend, shape: Shape) -> Step:
    """Construct the backend's buffer on the EP group."""
    import torch.distributed as dist

    with timed_step("buffer") as step:
        sync(rt)
        dist.barrier(group=rt.ctrl_group)
        backend.create(rt.ep_group, shape)
        sync(rt)
        local = shape.local_experts(rt.env.world)
        step.detail = (
            f"{type(backend).__name__} on {rt.env.world} rank(s): {shape.tokens} tokens/rank, "
            f"hidden {shape.hidden}, {shape.experts} experts ({local}/rank), top-{shape.topk}"
        )
        for attr in ("num_nvl_bytes", "num_rdma_bytes"):
            if hasattr(backend, attr):
                step.data[attr] = getattr(backend, attr)
        facts = backend.facts()
        step.data.update(facts)
        step.detail += jit_cache_note(facts)
    return agree(rt, step)


def jit_cache_note(facts: dict[str, Any]) -> str:
    """The buffer step's words on a backend's own kernel cache (HybridEP's), if it has one."""
    if "jit_cache_state" not in facts:
        return ""
    if facts["jit_cache_state"] == "off":
        return f"; JIT cache off ({facts.get('jit_cache_reason') or 'not set'})"
    return (
        f"; JIT cache {facts.get('jit_cache_dir')} {facts['jit_cache_state']}, "
        f"{facts.get('jit_cache_files_before', 0)} kernel(s) before"
    )
