"""torch_xla launches: the supervisor between the helper and the TPU workers, and the
worker carrier ``torch_xla.launch`` calls per device.

May import ``bootstrap``, ``sharing`` (the payload's segments, handed to every rank) and the
launcher's ``control`` channel; nothing else of the launcher.
"""
