"""The probes: run inside a backend venv, they prove that what it holds works (docs/probes.md)."""
