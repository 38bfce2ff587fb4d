"""check_ep's backends behind one interface: ``base`` (the interface and its contract), one
adapter an API (a module and the class it drives: ``deep_ep.Buffer``, ``nccl.ep.Group``, ...),
each named after the file of that API in its package (``buffer``, ``elastic_buffer``,
``hybrid_ep_buffer``, what the ``deep_ep`` ones share in ``deep_ep_common``), the plain-torch
``torch_reference``, and ``plugins`` (which adapter a run drives: the one of the backend's API,
found by the ``module`` and ``api`` each adapter declares, or a class from ``--backend-class``)."""
