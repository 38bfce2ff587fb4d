"""check_ep's backends behind one interface: ``base`` (the interface and its contract), one
adapter a module (``torch_reference``, ``deepep_v1``, ``deepep_v2``, ``hybridep``, with what the
DeepEP ones share in ``deepep_common``), and ``plugins`` (which adapter a run drives, built in or
from ``--backend-class``)."""
