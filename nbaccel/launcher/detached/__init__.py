"""Detached runs (``detach=True``): a supervisor of their own that outlives the kernel, its
attach channel, the kernel's view of such a run, and the listing of run folders.

May import the launch itself and ``local`` (the supervisor starts its workers there).
"""
