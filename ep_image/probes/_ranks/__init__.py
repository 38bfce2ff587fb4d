"""The rank machinery every probe that drives a backend on ranks runs on (check_ep, check_train):
the shared flags (``cli``), the local launcher (``launch``), each rank's supervisor
(``supervisor``: ``board``, ``stall``, ``calls``) and its backend process (``worker``),
placement, groups and agreement (``runtime``), the gates and the one step loop (``gates``,
``steps``), and the report, of a finished run or of one that died (``output``,
``import_failure``); what is refused before any rank starts (``preflight``, ``selection``), and
the layer's shape and limits (``layer``). A probe is a :class:`types.ProbeKind`: its steps,
shape and report fields.

Importing any of it loads no torch: the worker imports torch, and each probe's steps import
what they need when they run.
"""
