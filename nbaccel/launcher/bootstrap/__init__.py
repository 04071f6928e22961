"""What a worker is sent and what it runs first, however it was started (forked by the
local helper, by torch elastic on another host, or by torch_xla): the payload (the pickled
function, arguments and config) and how it is pickled, the bootstrap that unpacks and runs
it with its output captured, the worker's memory reports, and Linux process controls.

Imports nothing of the launcher outside this folder but ``sharing`` (the payload's large
buffers in shared memory). The parent uses only ``payload`` and ``pickling`` (torch-free);
the rest runs in workers.
"""
