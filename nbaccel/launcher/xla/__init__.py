"""torch_xla launches: the supervisor between the helper and the TPU workers, and the
worker carrier ``torch_xla.launch`` calls per device.

May import ``bootstrap`` and the launcher's ``control`` channel; nothing else of the
launcher.
"""
