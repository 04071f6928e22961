"""Data that travels out of band: large buffers in shared memory, mapped by every local rank.

A launch's function, its arguments, what ``Workers.push`` sends and what ranks send back
are pickled with protocol 5 (PEP 574): numpy arrays, pandas' blocks, Arrow buffers, large
``bytes``/``bytearray`` and CPU tensors give their buffers to a callback instead of copying
them into the pickle. ``segments`` puts such buffers into memfd segments (anonymous shared
memory: no name, no file, gone when the last process holding it closes it; ``memfd`` makes
them where Python lacks ``os.memfd_create``, and seals them once written) and maps them
in each rank, copy-on-write; ``packing`` joins the small pickle and its buffer references
into what travels, and reads it back; ``cache`` keeps the kernel's segments between
launches, so data that did not change (``digests`` tells) is not copied again.

The lowest room of the launcher: stdlib and xxhash only (torch only through
``sys.modules``, where a process already has it), imports nothing of the launcher.
``bootstrap`` (payload, worker side), ``local``, ``remote``, ``detached`` and
``interactive`` call it.
"""
