"""What an interactive launch runs on each rank: ``serve_on_rank`` (and ``serve_kept``, once a
``keep_workers`` launch's function returned), in a module the
torch-free kernel can import (the payload names it by reference), apart from the serve loop
(``serve.py``, which imports torch) and from the wire it speaks (``wire.py``)."""

from __future__ import annotations


def serve_on_rank(address: str, token: str) -> None:
    """Connect back to the kernel at ``address`` and serve its commands until it closes."""
    from nbaccel.launcher.interactive.serve import serve

    serve(address, token)


def serve_kept(address: str, token: str, names: dict[str, object]) -> None:
    """A ``keep_workers`` rank whose function returned: serve the kernel's commands in a
    namespace that starts with ``names`` (the function's globals from the kernel, and its
    value as ``result``), until the kernel closes."""
    from nbaccel.launcher.interactive.serve import serve

    serve(address, token, namespace=dict(names), trained=True)
