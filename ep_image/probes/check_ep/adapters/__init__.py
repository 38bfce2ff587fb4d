"""check_ep's backends behind one interface: ``base`` (the interface and its contract), one
adapter a ``deep_ep`` API, each module named after the file of that API in ``deep_ep``
(``buffer``: ``Buffer``, ``elastic_buffer``: ``ElasticBuffer``, ``hybrid_ep_buffer``:
``HybridEPBuffer``; what they share in ``deep_ep_common``), the plain-torch
``torch_reference``, and ``plugins`` (which adapter a run drives: the one of the backend's API,
or a class from ``--backend-class``)."""
