"""What an interactive launch runs on each rank: ``serve_on_rank``, in a module the
torch-free kernel can import (the payload names it by reference), apart from the serve loop
(``serve.py``, which imports torch) and from the wire it speaks (``wire.py``)."""

from __future__ import annotations


def serve_on_rank(address: str, token: str) -> None:
    """Connect back to the kernel at ``address`` and serve its commands until it closes."""
    from nbaccel.launcher.interactive.serve import serve

    serve(address, token)
