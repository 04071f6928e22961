"""A debugger channel per rank: ``breakpoint()`` and post-mortems in the cell, stacks now.

Every rank of a run has one private, two-way channel to the kernel (a ``socketpair`` made by
the ``Run`` beside the rank's log and event pipes, handed to the worker with them; through
its agent for a rank on another host). Frames both ways are ``frames.encode_frame`` dicts.

The rank's side (``rank_channel.py``, ``rank_pdb.py``; stdlib only, torch never needed):
a daemon thread blocked on the channel answers "stacks" (``stacks.py``) whatever the main
thread does (a collective releases the GIL); ``breakpoint()`` and ``pdb.set_trace()`` ask the
kernel whether someone can type, then run a ``pdb.Pdb`` whose stdin and stdout are the
channel, or skip, saying why once. The kernel's side (``hub.py``: the run's sockets and a
reader thread; ``console.py``: the session shown in the cell and typed into with
``input()``) is torch-free. May import nothing of the launcher: only the base layer.
"""
