"""The launcher: from a function in a cell to running workers, and back (the parent side
never imports torch; the worker side runs in the processes it starts).

The launch itself lives at this folder's top: ``api`` (plan and start), ``checks`` (what is
refused before anything exists), ``planned`` (a checked launch as plain data), ``run`` and
``pump`` (one launch in flight: its events, output, exits and end), ``results`` (the
ranks' values until asked), ``run_folder``,
``output``, ``printer`` (text output), ``starter`` (what starts workers, as an interface),
``control`` (the fd-passing channel), ``remote_shell`` (how a command runs on another host)
and ``prewarm`` (the helper started at ``import nbaccel`` in a kernel). The rooms below it:

- ``sharing/``: large buffers (arrays, tensors) in shared memory, mapped by every local rank.
- ``bootstrap/``: what a worker is sent (the payload) and runs first, however it started.
- ``outcome/``: which rank failed, how the others are stopped, elastic restarts.
- ``local/``: one machine — the helper that forks workers, and ``start`` for a plan.
- ``remote/``: several machines — hosts, preflight, agents over SSH or srun, torch elastic.
- ``detached/``: runs that outlive the kernel — the supervisor, attaching, listing.
- ``xla/``: torch_xla launches — the supervisor and the per-device worker.

Each room's ``__init__`` says what it may import; tests/unit/test_import_layers.py holds it.
"""
