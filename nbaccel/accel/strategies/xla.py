"""The strategies on XLA devices (TPUs; torch_xla's CPU device in tests), through torch_xla.

Only processes that train through torch_xla import this module's torch_xla parts, and only
inside functions: nbaccel's main environment has no torch_xla. Two modes, as torch_xla has:

* Data parallel (``strategy='xla'``, or ``'auto'`` on a TPU): one rank per XLA device (a
  process each, or threads of one process on TPU v2/v3). The model is replicated, not
  wrapped: rank 0's initial weights are broadcast (as DDP does) and the gradients are
  all-reduced in the optimizer step (``xm.reduce_gradients``, what ``xm.optimizer_step``
  does), only on steps that sync, so gradient accumulation needs no ``no_sync``.
* SPMD with FSDPv2 (``strategy='fsdp'``): one process drives every device. Parameters are
  sharded along the ``fsdp`` axis of a (devices, 1) mesh; each global batch is loaded once
  and split along the same axis. nbaccel reports one process (``num_processes == 1``).

``distributed_type`` is ``DistributedType.XLA`` in both modes, as in Hugging Face Accelerate,
so code that branches on it for TPUs keeps working. torch_xla records operations lazily and
compiles them into graphs at each ``torch_xla.sync()``; where nbaccel syncs, a comment says
why. Collectives use torch_xla's own (``xm.all_gather``, ``xm.rendezvous``): a
torch.distributed group exists only with one device per process, never across threads.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from typing import Any

import torch

from nbaccel.accel.checkpoints.checkpoint import DeviceHooks
from nbaccel.accel.nested import collectives
from nbaccel.accel.nested.collectives import tree_map
from nbaccel.accel.precision import Precision
from nbaccel.accel.state import ProcessState
from nbaccel.accel.strategies import xla_prepare
from nbaccel.accel.strategies.base import Batches, ParameterSwap, Strategy
from nbaccel.accel.strategies.xla_prepare import Batch
from nbaccel.config.accelerator_options import AcceleratorOptions
from nbaccel.config.schema import Config


class XlaDataParallel(Strategy):
    """Replicas on XLA devices: torch_xla's collectives, graph cuts, device loaders."""

    name = "xla"

    def __init__(
        self, state: ProcessState, config: Config, options: AcceleratorOptions | None = None
    ) -> None:
        super().__init__(state, config, options)
        self.device = state.device
        self.mesh: Any = None  # SPMD's device mesh (XlaSpmd); None in data parallel
        self._loaders_syncing = 0  # torch_xla loaders mid-iteration (they sync per batch)

    # -- graph cuts and collectives ------------------------------------------------------
    def sync(self) -> None:
        """Compile and run what was recorded so far (``torch_xla.sync()``)."""
        import torch_xla

        torch_xla.sync()

    def after_step(self) -> None:
        """Called after each real optimizer step."""
        # Cut the graph at the step, unless a torch_xla loader does it at the next batch:
        # otherwise each step's operations join one ever-growing graph, compiled anew.
        if not self._loaders_syncing:
            self.sync()

    def barrier(self) -> None:
        self._barrier("nbaccel.wait_for_everyone")

    def _barrier(self, tag: str) -> None:
        # A sync first: the barrier is also the point where every rank's work is issued.
        self.sync()
        if self.state.world_size > 1:
            import torch_xla.core.xla_model as xm

            xm.rendezvous(tag)

    def _collective(self, one: Callable[[torch.Tensor], torch.Tensor], data: Any) -> Any:
        # Sync before: the collective then runs in a graph of its own, identical on every
        # rank (pending work may differ between ranks). Sync after: results are computed
        # once, not by each read of each tensor.
        self.sync()
        result = tree_map(lambda t: one(t.to(self.device)), data)
        self.sync()
        return result

    def gather(self, data: Any) -> Any:
        """``collectives.gather`` over XLA devices (one process: a copy, as there)."""
        if self.state.world_size == 1:
            return collectives.gather(data)
        import torch_xla.core.xla_model as xm

        return self._collective(
            lambda t: xm.all_gather(t.reshape(1) if t.dim() == 0 else t, dim=0), data
        )

    def reduce(self, data: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        """``collectives.reduce`` over XLA devices."""
        if self.state.world_size == 1 or reduction == "none":
            return collectives.reduce(data, reduction, scale)
        import torch_xla.core.xla_model as xm

        world = self.state.world_size
        divisor = world if reduction == "mean" else 1

        def one(tensor: torch.Tensor) -> torch.Tensor:
            summed: torch.Tensor = xm.all_reduce(
                xm.REDUCE_SUM, tensor.clone(), scale=scale / divisor
            )
            return summed

        return self._collective(one, data)

    def gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj`` in rank order; lists are concatenated."""
        if self.state.world_size == 1:
            return collectives.gather_object(obj)
        import torch_xla.core.xla_model as xm

        parts = [pickle.loads(p) for p in xm.rendezvous("nbaccel.gather_object", _dumps(obj))]
        if all(isinstance(p, list) for p in parts):
            return [item for part in parts for item in part]
        return parts

    def share(self, value: int) -> int:
        return int(self.share_object(value))

    def share_object(self, obj: Any) -> Any:
        """Rank 0's picklable ``obj``, on every rank (a broadcast)."""
        if self.state.world_size == 1:
            return obj
        import torch_xla.core.xla_model as xm

        mine = _dumps(obj) if self.state.rank == 0 else b""
        return pickle.loads(xm.rendezvous("nbaccel.share", mine)[0])

    def pad_across_processes(self, data: Any, dim: int, pad_index: int, first: bool) -> Any:
        distributed = self.state.world_size > 1
        return collectives.pad_across_processes(
            data, dim, pad_index, first, gather_sizes=self.gather if distributed else None
        )

    # -- optimizer and checkpoints -------------------------------------------------------
    def optimizer_hooks(self) -> dict[str, Any]:
        """``AcceleratedOptimizer`` arguments: gradient all-reduce and the step's graph cut."""
        reduce = None
        if self.state.world_size > 1:  # never under SPMD: there the compiler reduces
            import torch_xla.core.xla_model as xm

            reduce = xm.reduce_gradients
        return {"reduce": reduce, "after_step": self.after_step}

    @property
    def checkpoint_layout(self) -> str:
        return "plain"  # whole tensors, copied to the host (FSDPv2's arrive whole too)

    def checkpoint_hooks(self) -> DeviceHooks:
        import torch_xla.core.xla_model as xm

        return DeviceHooks(
            to_host=self.to_host,
            barrier=lambda: self._barrier("nbaccel.checkpoint"),
            share=self.share_object,
            rng_state=lambda: int(xm.get_rng_state()),
            set_rng_state=lambda seed: xm.set_rng_state(int(seed)),
            after_load=self.sync,  # the loaded values become device data, not pending copies
        )

    def to_host(self, data: Any) -> Any:
        """CPU copies of the device tensors in ``data`` (state dicts), for ``torch.save``."""
        # One sync computes every pending value; the copies after it only transfer. Sharded
        # (SPMD) tensors arrive whole.
        self.sync()
        return tree_map(
            lambda t: t.cpu() if t.device.type == "xla" else t, data, other=lambda leaf: leaf
        )

    # -- models and batches ---------------------------------------------------------------
    def prepare_model(
        self,
        model: torch.nn.Module,
        precision: Precision,
        *,
        device_placement: bool,
        ddp_kwargs: dict[str, Any],
    ) -> tuple[torch.nn.Module, ParameterSwap]:
        """See ``xla_prepare.prepare_model``."""
        return xla_prepare.prepare_model(
            model, self.state, self.mesh, precision, device_placement, self.config
        )

    def before_save(self) -> None:
        self.sync()  # one graph computes every pending weight before the copies

    def full_state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        weights: dict[str, torch.Tensor] = self.to_host(super().full_state_dict(model))
        return weights

    def device_stream(self) -> Callable[[Batches], Batches]:
        return self._stream

    def _stream(self, batches: Iterator[Batch]) -> Iterator[Batch]:
        """``batches`` on the device; see ``xla_prepare.device_stream``."""
        self._loaders_syncing += 1  # it syncs before each batch: the step need not
        try:
            yield from xla_prepare.device_stream(batches, self.device, self.mesh)
        finally:
            self._loaders_syncing -= 1


class XlaSpmd(XlaDataParallel):
    """FSDPv2 under SPMD: one process drives every device; parameters are sharded along the
    ``fsdp`` axis of the mesh and the compiler inserts the communication."""

    name = "xla-spmd"

    def __init__(
        self, state: ProcessState, config: Config, options: AcceleratorOptions | None = None
    ) -> None:
        super().__init__(state, config, options)
        self.mesh = xla_prepare.fsdp_mesh()


def _dumps(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
