"""ep_image: what scripts/, probes/ and the image's stages share, in one importable place.

Why a package at the top level: scripts run on build hosts, probes run inside backend venvs that
hold only the lock's packages, and the image's stages run on a bare base image. None of them can
install this project, so each reaches it by path: the repository root in a checkout, and
``/opt/ep-image`` in the image (where it sits beside scripts/ and probes/ exactly as in the
repository). Standard library only, for the same reason.

Modules: ``backends`` (the registry of EP backends: the one place a backend is defined),
``project`` (pins read from pyproject.toml and uv.lock), ``nvshmem`` (HybridEP's NVSHMEM build
set-up, shared by host mode and the image), ``tools`` (the pinned uv), ``dockerfile`` (the
per-backend Dockerfile stages, rendered from the registry), ``image`` (the image's assembling
steps).
"""
