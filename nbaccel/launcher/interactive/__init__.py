"""Interactive workers: one long launch whose ranks keep their namespaces between calls.

``workers.py`` (parent side, torch-free) starts a launch whose function is ``serve.serve``
(worker side: it may import torch) and talks to every rank over a private Unix socket
(``wire.py``, stdlib only); ``relay.py`` hands the run's output to whichever call is current.
May import ``api``, ``run``, ``printer``, ``pump``, ``control``, ``outcome`` and
``bootstrap`` (the worker side's error reports), and the base layer.
"""
