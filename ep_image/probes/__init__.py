"""The probes: run inside a backend venv, they prove that what it holds works (docs/probes.md)."""

import warnings

# Every probe imports this package before torch. The probes never use numpy, and must run where
# it is absent (a venv that leaves it out); torch's import warns about that on every run.
warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
