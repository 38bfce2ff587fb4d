"""uv as the build steps run it: the pinned release and where it is found (``pinned``), the CA
store it trusts (``trust_store``), a run and its failures turned into one error (``run``)."""
