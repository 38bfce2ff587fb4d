"""The backends behind one interface, driven by every probe on the rank machinery (check_ep,
check_train): ``base`` (the interface, its contract, and the types it speaks in), one adapter an
API (a module and the class it drives: ``deep_ep.Buffer``, ``nccl.ep.Group``, ...), each named
after the file of that API in its package (``buffer``, ``elastic_buffer``, ``hybrid_ep_buffer``,
what the ``deep_ep`` ones share in ``deep_ep_common``), the plain-torch ``torch_reference``, and
``plugins`` (which adapter a run drives: the one of the backend's API, found by the ``module``
and ``api`` each adapter declares, or a class from ``--backend-class``).

A backend on a new API needs one new module here, and nothing else in the probes."""
