"""The worker side: ``Accelerator`` and what it is built from. Imports torch.

Only worker processes import this package (``nbaccel.Accelerator`` loads it on first use),
so the kernel that launches stays free of torch.
"""

from nbaccel.accel.accelerator import Accelerator
from nbaccel.accel.data import send_to_device
from nbaccel.accel.state import DistributedType, ProcessState

__all__ = ["Accelerator", "DistributedType", "ProcessState", "send_to_device"]
