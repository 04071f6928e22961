"""One machine: the helper process (a clean interpreter with torch preloaded that forks
workers and spares on request), its parent-side handle, the worker it forks, orphans swept
when a run ends, and ``start``, which starts a planned launch's workers here; what the
helper preloads is in ``preloading``.

May import the launch itself (the modules beside this folder), ``bootstrap``, ``sharing``
and ``xla``;
never ``remote`` or ``detached``.
"""
