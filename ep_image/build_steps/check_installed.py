#!/usr/bin/env python3
"""Say what an EP backend venv holds: installed, NOT yet proven to work.

`uv sync` succeeding only proves that files landed. Before the GPU probes run (check_ep
proves that a backend works), this check catches the cheap failures on any machine, GPU or not:
the wrong distribution providing `deep_ep`, two of them at once, a missing identifying file,
a compiled extension whose shared libraries the dynamic loader would not find (asked in
trace mode, as `ldd` does: ep_image/native/loader.py), or one that needs symbols those libraries do
not export, e.g. built against another torch (bound by the loader: ep_image/native/abi.py). It never
imports `deep_ep` (that needs a GPU driver), so it runs on CPU-only CI and build hosts.

    check-installed --venv /opt/venvs/BACKEND --backend BACKEND [--json PATH]
    (from a checkout: python3 -m ep_image.build_steps.check_installed ...)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ep_image import backends as ep_backends
from ep_image import cli
from ep_image.build_steps._venv import dist_records
from ep_image.build_steps._venv.layout import VENV_RECORD, VenvError, site_packages
from ep_image.files.records import write_json
from ep_image.native import abi, loader

# Provided by the GPU driver on the host at run time, never by a venv or an image.
DRIVER_LIBS = frozenset({"libcuda.so.1", "libnvidia-ml.so.1"})
DRIVER_WHERE = "GPU driver (host, at run time)"

PROG = "check_installed"
EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2


@dataclass
class Report:
    """What landed in the venv; `problems` empty means installed as expected."""

    venv: str
    backend: str
    status: str = "installed, not yet proven to work"
    site_packages: str = ""
    distributions: dict[str, str] = field(default_factory=dict)
    marker: str = ""
    extensions: dict[str, dict[str, str | None]] = field(default_factory=dict)
    ld_library_path: str = ""  # the environment the loader was asked in
    abi: list[dict[str, object]] = field(default_factory=list)  # symbols bound, per extension
    problems: list[str] = field(default_factory=list)


def find_site_packages(venv: Path) -> Path:
    """The venv's site-packages (lib/pythonX.Y/site-packages)."""
    try:
        return site_packages(venv)
    except VenvError as exc:
        raise FileNotFoundError(str(exc)) from None


def installed_distributions(site: Path) -> dict[str, str]:
    """Normalised distribution name -> version, read from *.dist-info directories."""
    dists: dict[str, str] = {}
    for info in site.glob("*.dist-info"):
        metadata = info / "METADATA"
        if not metadata.is_file():
            continue
        name = version = ""
        for line in metadata.read_text(errors="replace").splitlines():
            if line.startswith("Name:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("Version:"):
                version = line.split(":", 1)[1].strip()
            elif not line:
                break
        if name:
            dists[ep_backends.normalize(name)] = version
    return dists


def resolve_extensions(
    site: Path, report: Report, distribution: str = "", module: str = ep_backends.MODULE
) -> None:
    """Ask the dynamic loader where each library a backend's compiled code needs comes from:
    ``deep_ep``'s extensions, and every compiled object ``distribution`` installed (its RECORD:
    NCCL EP's libnccl_ep.so and its bindings).

    The loader's own rules decide (RUNPATH and ``$ORIGIN``, LD_LIBRARY_PATH, ldconfig, torch's
    libraries loaded first), so a same-named file elsewhere in site-packages satisfies nothing.
    Only the GPU driver's libraries may be missing: the host provides them at run time.
    """
    extensions = [
        *site.glob("deep_ep/*.so"),
        *site.glob("deep_ep_cpp*.so"),
        *site.glob("hybrid_ep_cpp*.so"),
        *(abi.distribution_extensions(site, [distribution]) if distribution else []),
    ]
    extensions = list(dict.fromkeys(extensions))
    if not extensions:
        missing = f"no compiled {module} extension (*.so) found: the build did not land"
        report.problems.append(missing)
        return
    report.ld_library_path = os.environ.get("LD_LIBRARY_PATH", "")
    preload = loader.torch_first(site)
    for ext in extensions:
        direct, deeper = loader.resolve(ext, preload)
        resolved: dict[str, str | None] = {}
        for needed, where in direct.items():
            if where is None and needed in DRIVER_LIBS:
                resolved[needed] = DRIVER_WHERE
                continue
            resolved[needed] = where
            if where is None:
                report.problems.append(
                    f"{ext.name} needs {needed}, which the dynamic loader does not find (its "
                    "RUNPATH, LD_LIBRARY_PATH, ldconfig, or torch's libraries): install the "
                    "package that ships it (e.g. nvidia-nvshmem-cu13, nvidia-nccl-cu13) or fix "
                    "the extension's RUNPATH"
                )
        for needed in deeper:
            if needed not in DRIVER_LIBS:
                report.problems.append(
                    f"{ext.name}: {needed}, needed by one of its libraries, is not found by the "
                    "dynamic loader: install the package that ships it"
                )
        report.extensions[str(ext.relative_to(site))] = resolved


#: Distributions whose compiled code must bind to the venv's torch besides the backend's.
TE_DISTRIBUTIONS = ("transformer-engine", "transformer-engine-torch", "transformer-engine-cu13")


def check_symbols(venv: Path, site: Path, distributions: list[str], report: Report) -> None:
    """Bind every symbol the extensions of ``distributions`` (what ships ``deep_ep`` here) and
    TE's need, as importing them would (ep_image/native/abi.py): a library that is found can
    still lack the symbol an extension built against another version needs."""
    python = venv / "bin" / "python"
    results = abi.check(site, python, [*distributions, *TE_DISTRIBUTIONS])
    report.abi = [r.to_json() for r in results]
    for result in results:  # libraries not found are already problems (resolve_extensions)
        report.problems += result.problems(abi.torch_version(site), strict=False)


def recorded_versions(venv: Path, installed: dict[str, str]) -> list[str]:
    """Distributions whose version differs from what the venv's record (ep-backend.json) says
    was installed."""
    try:
        record = json.loads((venv / VENV_RECORD).read_text())
    except (OSError, ValueError):
        return []
    problems = []
    for entry in record.get("installed") or []:
        name, version = ep_backends.normalize(entry["name"]), entry["version"]
        if name in installed and installed[name] != version:
            problems.append(
                f"{name} {installed[name]} is installed, but {VENV_RECORD} records "
                f"{version}: rebuild the venv with make_venv"
            )
    return problems


def check(venv: Path, backend: str) -> Report:
    """Inspect one venv for one backend without importing anything from it."""
    report = Report(venv=str(venv), backend=backend)
    site = find_site_packages(venv)
    report.site_packages = str(site)
    dists = installed_distributions(site)
    registry = ep_backends.load_registry()
    wanted = registry[backend]
    module = ep_backends.spec(backend).module
    shippers = {ep_backends.normalize(d) for d in ep_backends.known_distributions(module)}
    present = {d: dists[d] for d in sorted(shippers) if d in dists}
    report.distributions = present
    if wanted.distribution not in present:
        report.problems.append(
            f"no distribution of {backend} ({wanted.distribution}) installed: "
            f"sync with `uv sync --extra {backend}`"
        )
    if len(present) > 1:
        report.problems.append(
            f"several distributions ship {module} ({', '.join(present)}): they overwrite each "
            "other; make one venv per backend"
        )
    marker = site / wanted.marker_file
    report.marker = str(marker)
    if not marker.is_file():
        report.problems.append(
            f"{wanted.marker_file} missing: {module} here is not {backend}'s layout"
        )
    report.problems += [
        f"{problem}: the venv is not what was installed (a damaged uv cache entry, or an edit); "
        "rebuild it with make_venv"
        for problem in dist_records.verify(site)
    ]
    report.problems += recorded_versions(venv, dists)
    resolve_extensions(site, report, wanted.distribution, module)
    check_symbols(venv, site, [*present, wanted.distribution], report)
    report.status = "problems found" if report.problems else "installed, not yet proven to work"
    return report


def print_report(report: Report) -> None:
    print(f"{report.backend} in {report.venv}: {report.status}")
    for dist, version in report.distributions.items():
        print(f"  dist      {dist}=={version}")
    for ext, libs in report.extensions.items():
        for lib, where in libs.items():
            print(f"  {ext:<40} {lib:<28} {where or 'NOT FOUND'}")
    for result in report.abi:
        name = Path(str(result["extension"])).name
        verdict = "symbols bind" if result["ok"] else "symbols DO NOT bind"
        driver = "" if result["driver"] == "real" else f" (GPU driver: {result['driver']})"
        print(f"  {name:<40} {verdict}{driver}")
    for problem in report.problems:
        print(f"  PROBLEM   {problem}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = cli.Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Exit codes: 0 installed as expected; 1 problems found (listed); 2 bad usage, "
        "or a --venv that cannot be inspected.",
    )
    parser.add_argument("--venv", type=Path, required=True, help="the venv to inspect")
    parser.add_argument("--backend", required=True, help=f"one of {ep_backends.valid_names_text()}")
    parser.add_json("also write the report here")
    args = parser.parse_args(argv)
    try:
        ep_backends.validate_backend(args.backend)
    except ep_backends.UnknownBackendError as error:
        raise cli.UsageError(str(error)) from None
    return args


def run(args: argparse.Namespace) -> int:
    try:
        report = check(args.venv, args.backend)
    except FileNotFoundError as error:
        raise cli.FixableError(
            str(error),
            "pass --venv <prefix>/<backend>, a venv that make_venv built",
            EXIT_USAGE,
        ) from None
    except loader.LoaderError as error:
        raise cli.FixableError(
            str(error), "run it on a glibc Linux system, whose ld.so can trace the venv", EXIT_USAGE
        ) from None
    print_report(report)
    if args.json:
        write_json(args.json, asdict(report), sort_keys=False)
    if not report.problems:
        return EXIT_OK
    # The report above says what is wrong; the last line, like every refusal's, says what to do.
    sys.stdout.flush()
    print(
        f"{PROG}: fix: rebuild the venv from the lock (python3 scripts/make_venv.py --backend "
        f"{args.backend} --prefix DIR builds DIR/{args.backend}); each PROBLEM above names its "
        "cause",
        file=sys.stderr,
    )
    return EXIT_PROBLEM


def main(argv: Sequence[str] | None = None) -> int:
    return cli.run(PROG, parse_args, run, argv)


if __name__ == "__main__":
    sys.exit(main())
