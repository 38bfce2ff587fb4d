"""The repository's own layout: the front doors a user types (``front_doors``), the package's
import graph (``import_graph``) and the Dockerfile parts generated from the registry and that
graph (``dockerfile``). Standard library only."""
