"""Interactive workers: one long launch whose ranks keep their namespaces between calls.

``workers.py`` (parent side, torch-free) plans and starts a launch whose function is
``serve.serve`` (worker side: it may import torch); ``connect.py`` takes each rank's
connection back (an abstract Unix socket, or TCP with ``hosts=``), checked with ``wire.py``'s
handshake; ``calls.py`` sends commands and reads replies on threads of their own;
``ending.py`` collects a call's replies under interrupts and ends the group when a rank
fails, hangs or dies; ``relay.py`` hands the run's output and events to the display of the
call in progress. May import ``api``, ``planned``, ``run``, ``printer``, ``pump``,
``control``, ``outcome``, ``output`` (the mark that ends each command's output),
``bootstrap`` (the worker side's error reports and the payload), ``sharing`` (values'
buffers in shared memory, their fds on the Unix socket), and the base layer.
"""
