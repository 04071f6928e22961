"""Models and batches on XLA devices: replicas or FSDPv2, and torch_xla's background loader.

Part of ``nbaccel.accel.strategies.xla`` (see there for the two modes); torch_xla is imported inside
the functions only. Under SPMD ``mesh`` is the (devices, 1) mesh with axes ``fsdp`` and
``model``; in data parallel it is None.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch

from nbaccel.accel.nested.collectives import tree_map
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import ProcessState
from nbaccel.accel.strategies import models
from nbaccel.accel.strategies.sharding import wrap_units
from nbaccel.config.schema import Config

Batch = tuple[Any, bool, int]  # a batch, whether it is the epoch's last, its real samples


def fsdp_mesh() -> Any:
    """The SPMD mesh over every device: axis ``fsdp`` shards, axis ``model`` has size 1."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    count = xr.global_runtime_device_count()
    mesh = xs.Mesh(np.arange(count), (count, 1), ("fsdp", "model"))
    xs.set_global_mesh(mesh)  # for user code that shards more (xs.get_global_mesh())
    return mesh


def prepare_model(
    model: torch.nn.Module,
    state: ProcessState,
    mesh: Any,
    precision: Precision,
    placement: bool,
    config: Config,
) -> tuple[torch.nn.Module, dict[int, torch.nn.Parameter]]:
    """The model on the XLA device (replicated, or FSDPv2 under SPMD), and
    {id(old parameter): new parameter}: moving to XLA replaces every parameter object, so
    an optimizer built before ``prepare`` is pointed at the new ones (as for FSDP)."""
    names = {id(p): name for name, p in model.named_parameters()}
    if mesh is not None:
        prepared = _fsdp_v2(model, state, mesh, precision, config)
    else:
        prepared = models.prepare_model(
            model,
            state,
            precision,
            device_placement=placement,
            dynamo_backend=config.dynamo_backend,
        )
        if state.world_size > 1:
            import torch_xla.core.xla_model as xm

            # Replicas must start equal; DDP broadcasts rank 0's weights, so do we.
            xm.broadcast_master_param(model)
    new = dict(model.named_parameters())
    return prepared, {old: new[name] for old, name in names.items() if name in new}


def _fsdp_v2(
    model: torch.nn.Module, state: ProcessState, mesh: Any, precision: Precision, config: Config
) -> torch.nn.Module:
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import (
        SpmdFullyShardedDataParallel,
    )

    if wrap_units(model, config.fsdp):
        warnings.warn(
            "strategy='fsdp' on XLA: FSDPv2 wraps the whole model as one unit (every "
            "parameter is still sharded over all devices); per-layer units are not "
            "supported yet, so fsdp_auto_wrap_policy is not applied.",
            stacklevel=6,
        )
    # Wrapped first: FSDPv2 checks that the module defines forward, which the autocast
    # forward nbaccel adds (on the inner module, as for the other strategies) would fail.
    wrapped: torch.nn.Module = SpmdFullyShardedDataParallel(
        model, mesh=mesh, shard_output=_shard_output
    )
    models.prepare_model(model, state, precision, device_placement=False, dynamo_backend="no")
    if config.dynamo_backend != "no":
        model.compile(backend=config.dynamo_backend)  # in place: the wrapper still calls it
    return wrapped


def _batch_spec(tensor: torch.Tensor) -> tuple[str | None, ...]:
    return ("fsdp",) + (None,) * (tensor.dim() - 1)


def _shard_output(output: Any, mesh: Any) -> None:
    # FSDPv2 needs the forward's output sharded along the batch to run as FSDP. Its default
    # takes a tensor or a tuple's first item; this one also finds the logits in a dict
    # (transformers' ModelOutput) and skips scalars such as a loss the model computed.
    import torch_xla.distributed.spmd as xs

    found: list[torch.Tensor] = []
    tree_map(lambda t: found.append(t) if t.dim() > 0 else None, output, other=lambda x: x)
    if found:
        xs.mark_sharding(found[0], mesh, _batch_spec(found[0]))


def device_stream(batches: Iterator[Batch], device: torch.device, mesh: Any) -> Iterator[Batch]:
    """``batches`` moved to ``device`` by torch_xla's background loader (the engine of
    ``MpDeviceLoader``, which syncs before each batch), split along ``fsdp`` under SPMD.

    torch_xla's loader reads ahead in a thread and rebuilds what it moves (tuples become
    lists); so each batch travels as its flat tensors plus an opaque record of its structure
    and position, and the training loop gets the user's types back.
    """
    import torch_xla.distributed.parallel_loader as pl

    failures: list[BaseException] = []
    sharding = _BatchSharding(mesh) if mesh is not None else None
    parallel = pl.ParallelLoader(_packed(batches, failures), [device], input_sharding=sharding)
    try:
        for tensors, record in parallel.per_device_loader(device):
            skeleton, last, remainder = record.value
            yield _unflatten(skeleton, tensors, device), last, remainder
    finally:
        parallel.close()  # also when the loop stopped early: ends its threads
    if failures:  # raised in the loader's thread, where torch_xla would only print it
        raise failures[0]


class _BatchSharding:
    """``input_sharding`` for torch_xla's loader: every tensor split along dim 0 over the
    ``fsdp`` axis, whatever its rank (a ``ShardingSpec`` fits tensors of one rank only)."""

    minibatch = False  # read by torch_xla: each batch is global, not this host's part

    def __init__(self, mesh: Any) -> None:
        self.mesh = mesh
        self._specs: dict[int, Any] = {}

    def xla_spec(self, tensor: torch.Tensor) -> Any:
        if tensor.dim() == 0:
            return None  # replicated
        import torch_xla.distributed.spmd as xs

        spec = self._specs.get(tensor.dim())
        if spec is None:
            spec = self._specs[tensor.dim()] = xs.ShardingSpec(self.mesh, _batch_spec(tensor))
        return spec.xla_spec(tensor)


class _Opaque:
    """A value torch_xla's loader passes through untouched (it rewrites what has __dict__)."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class _Slot(_Opaque):
    """Where the n-th tensor of a flattened batch goes back."""

    __slots__ = ()


def _packed(batches: Iterator[Batch], failures: list[BaseException]) -> Iterator[list[Any]]:
    try:
        for batch, last, remainder in batches:
            tensors: list[torch.Tensor] = []

            def take(t: torch.Tensor, tensors: list[torch.Tensor] = tensors) -> _Slot:
                tensors.append(t)
                return _Slot(len(tensors) - 1)

            skeleton = tree_map(take, batch, other=lambda leaf: leaf)
            yield [tensors, _Opaque((skeleton, last, remainder))]
    except Exception as error:  # noqa: BLE001 - re-raised in the training loop
        failures.append(error)


def _unflatten(skeleton: Any, tensors: list[torch.Tensor], device: torch.device) -> Any:
    def leaf(value: Any) -> Any:
        if isinstance(value, _Slot):
            return tensors[value.value]
        # Objects with their own .to() (transformers' BatchEncoding), as send_to_device does.
        return value.to(device) if callable(getattr(value, "to", None)) else value

    return tree_map(lambda t: t, skeleton, other=leaf)
