"""Compiled code read without loading it: an ELF file's dynamic section (``elf``), where the
real loader finds each library it needs (``loader``), whether its symbols bind to the libraries
beside it (``abi``). Standard library only; docs/backends.md, "Checking the ABI without a GPU"."""
