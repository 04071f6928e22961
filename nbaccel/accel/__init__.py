"""The worker side: ``Accelerator`` and what it is built from. Imports torch.

Only worker processes import this package (``nbaccel.Accelerator`` loads it on first use),
so the kernel that launches stays free of torch.

The facade and its parts live at this folder's top: ``accelerator`` (the ``Accelerator``,
its members forwarded from its parts by ``forwarding``), ``state`` / ``partial_state`` (who
this process is), ``preparation`` (what ``prepare`` made), ``training_step`` (backward,
sync, clipping), ``communication``, ``checkpointing`` (``save_state`` / ``load_state``),
``optim``, ``precision``, ``trigger``, ``lomo`` and ``refusals`` (Accelerate's API that
nbaccel refuses by name, with the reason). The rooms below it:

- ``nested/``: nested tensors — tree_map, collectives over them, batches.
- ``data/``: dataloaders as ``prepare`` returns them, samplers, skipping, splitting.
- ``checkpoints/``: checkpoint folders and files, DCP, weight files.
- ``strategies/``: one class per backend, and what wraps a model for it.
- ``tracking/``: trackers, the ``Tracking`` part, profiling, the step timer.

Each room's ``__init__`` says what it may import; tests/unit/test_import_layers.py holds it.
"""

from nbaccel.accel.accelerator import Accelerator
from nbaccel.accel.data.loaders import send_to_device
from nbaccel.accel.state import DistributedType, ProcessState

__all__ = ["Accelerator", "DistributedType", "ProcessState", "send_to_device"]
