"""Durable copies of checkpoints: a root that outlives the machine, and resuming from it.

A checkpoint root holds ``LATEST`` (one line: ``state-<name>``) and ``state-<name>/``
folders. Written locally first (atomically, by the savers), each new state is copied by a
:class:`DurableCopier` to a durable place: a folder (Colab's mounted Drive) or an fsspec URL
(``gs://``, ``s3://``, ``hf://``, ``memory://``, ``file://``). There LATEST moves only after
the state's files and its ``MANIFEST.json`` are uploaded and verified. On a new machine,
:func:`newest_complete` finds the newest complete state of each place, :func:`newest_of`
chooses among them, and :func:`fetch` brings a durable one to the local disk to load.

Modules: ``places`` (local folders and fsspec URLs behind one interface), ``manifest``
(sizes and sha256 of a state's files), ``points`` (finding and choosing states),
``fetching`` (download), ``copier`` (the background copies). The base layer: stdlib, plus
fsspec imported only when a URL is used; no torch, no launcher, no worker side.
"""

from __future__ import annotations

from nbaccel.durable.copier import DurableCopier
from nbaccel.durable.fetching import fetch
from nbaccel.durable.places import is_url
from nbaccel.durable.points import CheckpointPoint, newest_complete, newest_of

__all__ = ["CheckpointPoint", "DurableCopier", "fetch", "is_url", "newest_complete", "newest_of"]
