"""Per-device memory of a training run's model states, as ZeRO / FSDP sharding divides it.

The arithmetic of Rajbhandari et al., *ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models* (2020), for a model of Ψ parameters on N processes, applied to the engines
nbaccel runs. It counts what the engine keeps for the whole step: parameters, gradients,
optimizer state and DDP's gradient buckets. Activations, autograd's saved tensors, the
temporary buffers of collectives and allocator slack come on top and are not estimated.

``torch`` engine (nbaccel's DDP, ``ZeroRedundancyOptimizer`` and FSDP2 ``fully_shard``),
fp32 training, Adam/AdamW (8 bytes of state per parameter: ``exp_avg``, ``exp_avg_sq``):

====================  ==========  ==========  ============  ================================
stage                 parameters  gradients   optimizer     also
====================  ==========  ==========  ============  ================================
``ddp``               4Ψ          4Ψ          8Ψ            4Ψ gradient buckets
``zero1``             4Ψ          4Ψ          8Ψ/N          4Ψ gradient buckets
``zero2``             4Ψ/N + 4Ψ   4Ψ/N        8Ψ/N
``zero3``             4Ψ/N        4Ψ/N        8Ψ/N
====================  ==========  ==========  ============  ================================

Where this departs from the paper's table read for fp32 (16Ψ, 8Ψ + 8Ψ/N, 4Ψ + 12Ψ/N,
16Ψ/N; Ψ = 10⁶, N = 2: 16, 12, 10, 8 MB), it is because of how the engines hold memory
(each measured with ``benchmarks/sharding_memory.py``):

* DDP (and ZeRO-1, which runs under DDP) copies gradients into flat buckets for the
  all-reduce and keeps them for the whole run: 4Ψ more, unless the model was wrapped with
  ``gradient_as_bucket_view=True`` (then the gradients *are* the buckets).
* ZeRO-2 is FSDP with ``reshard_after_forward=False``: each rank keeps its fp32 shard (the
  parameter the optimizer updates, 4Ψ/N) *and* the all-gathered whole parameters from the
  forward until their backward, 4Ψ in fp32 (2Ψ in bf16/fp16). That is the figure at the
  step's peak, between forward and backward (12 MB, not the paper's 10, in the example
  above); at rest only the shard remains.
* ZeRO-1's ``ZeroRedundancyOptimizer`` gives each rank whole parameter tensors (greedily by
  size), so its state splits evenly only when the tensors do: 3 equal layers on 2 ranks
  leave 2/3 of the state on one rank. The estimate assumes an even split.
* ZeRO-3 (``FULL_SHARD``) all-gathers one wrapped block at a time and frees it after use.
  That transient copy (one block's parameters, two while the next one is prefetched) is not
  counted, nor are the root module's own parameters (those outside every wrapped block),
  which stay gathered through the whole forward and again through the whole backward: keep
  parameters inside wrapped blocks.
* Gradient accumulation with ``accumulate(model)`` (``no_sync_accumulation``): on the
  micro-steps that do not sync, FSDP keeps each rank's gradients whole and unreduced (an
  fp32 accumulator, 4Ψ, in bf16/fp16 too) until the syncing micro-step reduce-scatters
  them. ZeRO-2/3 gradients then take 4Ψ, as under DDP: the communication saved costs the
  gradient sharding. (``accumulate()`` without the model syncs every micro-step and keeps
  gradients sharded.)

Mixed precision (``bf16``/``fp16``) as nbaccel runs it:

* ``ddp`` / ``zero1``: the model stays fp32 and ``torch.autocast`` casts on the fly, so
  parameters and gradients are fp32 as in fp32 training (4Ψ each). Autograd also saves
  autocast's 16-bit copies of the matmul weights from forward to backward (up to 2Ψ more,
  measured 1.75 bytes per parameter for 8 Linear blocks): counted as activations, not here.
* ``zero2`` / ``zero3`` (FSDP with ``MixedPrecisionPolicy(param_dtype=bf16|fp16,
  reduce_dtype=fp32)``): the sharded fp32 master stays (4Ψ/N), the unsharded parameters are
  low precision (ZeRO-2 keeps them: 2Ψ; ZeRO-3: one block at a time, counted 0) and
  gradients reach the shard in fp32 (4Ψ/N).

``cpu_offload`` (FSDP's ``CPUOffloadPolicy``): the parameter, gradient and optimizer shards
live in host memory (``host``); the optimizer steps on the CPU. The device keeps only the
unsharded parameters it computes with (ZeRO-2: all of them from forward to backward).

``engine="deepspeed"`` uses the paper's own model: under mixed precision the model's
parameters and gradients are 16-bit (2Ψ each) and the optimizer state holds an fp32 master
copy besides Adam's moments (12Ψ, the paper's K); DeepSpeed's ZeRO optimizer keeps that fp32
partition in fp32 training too. Offload (``offload_optimizer``) moves the optimizer state and
gradient partitions to the host, ``offload_parameters`` the ZeRO-3 parameter partitions.

Plain arithmetic, stdlib only: the kernel imports this without torch.

>>> estimate_memory(1_000_000, world_size=2, stage="zero3").describe()
'7.63 MiB per device: parameters 1.91, gradients 1.91, optimizer 3.81'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nbaccel.config.schema import MIXED_PRECISIONS, Config

__all__ = [
    "OPTIMIZER_STATE_BYTES",
    "STAGES",
    "MemoryEstimate",
    "count_parameters",
    "estimate_for_config",
    "estimate_memory",
    "sharding_stage",
]

STAGES = ("ddp", "zero1", "zero2", "zero3")
ENGINES = ("torch", "deepspeed")
# Bytes of optimizer state per fp32 parameter (torch keeps state in the parameter's dtype).
OPTIMIZER_STATE_BYTES = {
    "adamw": 8,  # exp_avg + exp_avg_sq
    "adam": 8,
    "sgd_momentum": 4,  # momentum_buffer
    "sgd": 0,
    "adagrad": 4,  # sum
    "rmsprop": 4,  # square_avg (momentum=0, centered=False)
}
_FSDP_STAGES = {
    "FULL_SHARD": "zero3",
    "SHARD_GRAD_OP": "zero2",
    "NO_SHARD": "ddp",
    "HYBRID_SHARD": "zero3",  # within a machine: shard group = processes per machine
}
_DEEPSPEED_STAGES = ("ddp", "zero1", "zero2", "zero3")  # index = zero_stage
_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per device for one process's model states (see the module docs for the model).

    ``buffers`` is DDP's gradient buckets; ``host`` what CPU offload keeps in host memory
    instead of on the device (not part of ``total``).

    >>> e = MemoryEstimate(parameters=4_000, gradients=4_000, optimizer_state=8_000)
    >>> e.total
    16000
    >>> e.describe()
    '15.62 KiB per device: parameters 3.91, gradients 3.91, optimizer 7.81'
    """

    parameters: int
    gradients: int
    optimizer_state: int
    buffers: int = 0
    host: int = 0

    @property
    def total(self) -> int:
        """Device bytes: parameters + gradients + optimizer state + buffers."""
        return self.parameters + self.gradients + self.optimizer_state + self.buffers

    def describe(self) -> str:
        """One line for people, in the largest unit that fits (GiB, MiB or KiB)."""
        name, size = next(
            ((n, s) for n, s in _UNITS if max(self.total, self.host) >= s), _UNITS[-1]
        )
        parts = [
            f"parameters {self.parameters / size:.2f}",
            f"gradients {self.gradients / size:.2f}",
            f"optimizer {self.optimizer_state / size:.2f}",
        ]
        if self.buffers:
            parts.append(f"DDP buckets {self.buffers / size:.2f}")
        text = f"{self.total / size:.2f} {name} per device: " + ", ".join(parts)
        if self.host:
            text += f"; host memory {self.host / size:.2f} {name}"
        return text


def sharding_stage(config: Config) -> str:
    """The ZeRO stage a config asks for: ``"ddp"``, ``"zero1"``, ``"zero2"`` or ``"zero3"``.

    * ``strategy`` auto / ddp: ``"ddp"``, or ``"zero1"`` with ``shard_optimizer_state``.
    * ``strategy="fsdp"``: ``FULL_SHARD`` → ``"zero3"``, ``SHARD_GRAD_OP`` → ``"zero2"``,
      ``NO_SHARD`` → ``"ddp"`` (nothing is sharded; nbaccel runs it as FSDP with shard
      groups of one process, which ``estimate_for_config`` estimates as ``"zero3"`` over a
      group of 1: DDP's figures without its gradient buckets), ``HYBRID_SHARD`` →
      ``"zero3"`` within each machine: its shard group is the processes of one machine
      (``num_processes / num_machines``), replicated across machines;
      ``estimate_for_config`` divides by that group.
    * ``strategy="deepspeed"``: ``zero_stage`` 0, 1, 2, 3 → ddp, zero1, zero2, zero3.
    * ``strategy="xla"``: ``"ddp"`` (replicated data parallel).

    >>> sharding_stage(Config(strategy="fsdp"))
    'zero3'
    >>> sharding_stage(Config(shard_optimizer_state=True))
    'zero1'
    """
    if config.strategy == "fsdp":
        return _FSDP_STAGES[config.fsdp.sharding_strategy]
    if config.strategy == "deepspeed":
        return _DEEPSPEED_STAGES[config.deepspeed.zero_stage]
    if config.strategy == "xla":
        return "ddp"
    return "zero1" if config.shard_optimizer_state else "ddp"


def estimate_memory(
    num_params: int,
    *,
    world_size: int,
    stage: str,
    mixed_precision: str = "no",
    optimizer: str = "adamw",
    cpu_offload: bool = False,
    shard_group_size: int | None = None,
    engine: str = "torch",
    offload_parameters: bool = False,
    gradient_as_bucket_view: bool = False,
    no_sync_accumulation: bool = False,
) -> MemoryEstimate:
    """Bytes per device for ``num_params`` trainable parameters (the module docs give the model).

    ``shard_group_size`` is the number of processes a shard is split over (default
    ``world_size``; HYBRID_SHARD: the processes per machine). ``cpu_offload``: FSDP's CPU
    offload (torch engine, zero2/zero3) or DeepSpeed's ``offload_optimizer`` (zero1-3);
    ``offload_parameters``: DeepSpeed's ``offload_param`` (zero3). ``gradient_as_bucket_view``:
    DDP's option of that name (no separate gradient buckets). ``no_sync_accumulation``:
    gradients are accumulated over micro-steps without syncing (``accumulate(model)`` with
    ``gradient_accumulation_steps > 1``); no effect on DDP stages, nor on DeepSpeed, which
    accumulates into its partitions.

    The paper's numbers, Ψ = 10⁶ parameters on 2 processes, fp32, AdamW:

    >>> [estimate_memory(10**6, world_size=2, stage=s).total for s in STAGES]
    [20000000, 16000000, 12000000, 8000000]
    >>> e = estimate_memory(10**6, world_size=2, stage="zero1")
    >>> e.parameters + e.gradients + e.optimizer_state, e.buffers
    (12000000, 4000000)
    >>> e = estimate_memory(10**6, world_size=2, stage="zero3", cpu_offload=True)
    >>> e.total, e.host
    (0, 8000000)
    >>> estimate_memory(10**6, world_size=2, stage="zero4")
    Traceback (most recent call last):
    ...
    ValueError: stage='zero4' is not one of 'ddp', 'zero1', 'zero2', 'zero3'; ...
    """
    group = _check_arguments(
        num_params,
        world_size,
        stage,
        mixed_precision,
        optimizer,
        cpu_offload,
        shard_group_size,
        engine,
        offload_parameters,
    )
    level = STAGES.index(stage)  # what is sharded: 1 optimizer, 2 + gradients, 3 + parameters
    half = mixed_precision != "no"
    state = OPTIMIZER_STATE_BYTES[optimizer] * num_params

    def shard(nbytes: int, from_level: int) -> int:
        return -(-nbytes // group) if level >= from_level else nbytes

    if engine == "deepspeed":
        width = 2 if half else 4
        params, grads = shard(width * num_params, 3), shard(width * num_params, 2)
        # The ZeRO optimizer (and fp16/bf16 without ZeRO) keeps an fp32 master copy.
        master = 4 * num_params if (half or level >= 1) else 0
        optim = shard(master + state, 1)
        host = 0
        if cpu_offload:
            host, optim = optim, 0
            if level >= 2:
                host, grads = host + grads, 0
        if offload_parameters:
            host, params = host + params, 0
        return MemoryEstimate(params, grads, optim, host=host)

    if level <= 1:
        buckets = 0 if gradient_as_bucket_view else 4 * num_params
        return MemoryEstimate(4 * num_params, 4 * num_params, shard(state, 1), buckets)
    master, grads, optim = shard(4 * num_params, 2), shard(4 * num_params, 2), shard(state, 1)
    # ZeRO-2 keeps the all-gathered parameters from forward to backward, in param_dtype.
    unsharded = (2 if half else 4) * num_params if level == 2 else 0
    # Unsynced micro-steps accumulate whole fp32 gradients on the device (FSDP2).
    whole = 4 * num_params if no_sync_accumulation else 0
    if cpu_offload:
        return MemoryEstimate(unsharded, whole, 0, host=master + grads + optim)
    return MemoryEstimate(master + unsharded, max(grads, whole), optim)


def estimate_for_config(
    config: Config,
    num_params: int,
    *,
    world_size: int | None = None,
    optimizer: str = "adamw",
    no_sync_accumulation: bool | None = None,
) -> MemoryEstimate:
    """``estimate_memory`` for what ``config`` asks: stage, precision, offload, hybrid groups.

    ``world_size`` defaults to ``num_processes`` (every machine's processes together); pass
    it when ``num_processes`` is unset (one process per visible GPU). ``no_sync_accumulation``
    defaults to ``gradient_accumulation_steps > 1`` without ``sync_each_batch`` (the
    ``accumulate(model)`` idiom); pass False for a loop that uses ``accumulate()`` without
    the model.

    >>> config = Config(num_processes=2, strategy="fsdp", mixed_precision="bf16")
    >>> estimate_for_config(config, 10**6).total
    8000000
    """
    if world_size is None:
        if config.num_processes is None:
            raise ValueError(
                "num_processes is not set, so the number of processes is not known yet "
                "(one per visible GPU). Pass world_size=, or set num_processes."
            )
        world_size = config.num_processes
    stage = sharding_stage(config)
    engine = "deepspeed" if config.strategy == "deepspeed" else "torch"
    group = None
    offload = offload_params = False
    if config.strategy == "fsdp":
        offload = config.fsdp.cpu_offload
        if config.fsdp.sharding_strategy == "HYBRID_SHARD":
            group = world_size // config.num_machines
        elif config.fsdp.sharding_strategy == "NO_SHARD":
            # nbaccel runs NO_SHARD as FSDP2 on a (world, 1) mesh: shard groups of one
            # process, so ZeRO-3's arithmetic undivided (and no DDP gradient buckets).
            stage, group = "zero3", 1
    elif engine == "deepspeed" and stage != "ddp":
        offload = config.deepspeed.offload_optimizer_device != "none"
        offload_params = stage == "zero3" and config.deepspeed.offload_param_device != "none"
    return estimate_memory(
        num_params,
        world_size=world_size,
        stage=stage,
        mixed_precision=config.mixed_precision,
        optimizer=optimizer,
        cpu_offload=offload,
        shard_group_size=group,
        engine=engine,
        offload_parameters=offload_params,
        no_sync_accumulation=(
            config.gradient_accumulation_steps > 1 and not config.sync_each_batch
            if no_sync_accumulation is None
            else no_sync_accumulation
        ),
    )


def count_parameters(model: Any, *, trainable_only: bool = False) -> int:
    """Parameters of a model, by duck typing (``model.parameters()``): no torch import here.

    A parameter shared by several modules (tied embeddings) counts once. A sharded
    parameter (DTensor) counts its whole size. ``trainable_only`` skips those with
    ``requires_grad=False``: frozen parameters have no gradients or optimizer state.

    >>> class P:
    ...     def __init__(self, n): self.n = n
    ...     def numel(self): return self.n
    >>> class M:
    ...     def __init__(self): self.w = P(6); self.b = P(3)
    ...     def parameters(self): return iter([self.w, self.b, self.w])
    >>> count_parameters(M())
    9
    """
    parameters = getattr(model, "parameters", None)
    if not callable(parameters):
        raise TypeError(
            f"count_parameters() needs a model with a parameters() method (a torch.nn.Module), "
            f"got {type(model).__name__}. For a known size, pass the number to estimate_memory."
        )
    seen: dict[int, int] = {}
    for p in parameters():
        if trainable_only and not getattr(p, "requires_grad", True):
            continue
        seen[id(p)] = int(p.numel())
    return sum(seen.values())


def _check_arguments(
    num_params: int,
    world_size: int,
    stage: str,
    mixed_precision: str,
    optimizer: str,
    cpu_offload: bool,
    shard_group_size: int | None,
    engine: str,
    offload_parameters: bool,
) -> int:
    """Raise ValueError naming the bad argument and the fix; the shard group size."""
    for name, value, minimum in (("num_params", num_params, 0), ("world_size", world_size, 1)):
        if type(value) is not int or value < minimum:
            raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}.")
    for name, text, choices in (
        ("stage", stage, STAGES),
        ("mixed_precision", mixed_precision, MIXED_PRECISIONS),
        ("optimizer", optimizer, tuple(OPTIMIZER_STATE_BYTES)),
        ("engine", engine, ENGINES),
    ):
        if text not in choices:
            raise ValueError(
                f"{name}={text!r} is not one of {', '.join(map(repr, choices))}; pass one of those."
            )
    group = world_size if shard_group_size is None else shard_group_size
    if type(group) is not int or group < 1 or world_size % group:
        raise ValueError(
            f"shard_group_size={shard_group_size!r} must divide world_size={world_size} "
            "(HYBRID_SHARD: the processes per machine); leave it None to shard over all."
        )
    if cpu_offload and (stage == "ddp" or (stage == "zero1" and engine == "torch")):
        raise ValueError(
            f"cpu_offload=True moves sharded state to host memory, but stage={stage!r} "
            + (
                "shards nothing"
                if stage == "ddp"
                else "is torch's ZeroRedundancyOptimizer, which has no offload"
            )
            + ". Use stage 'zero2' or 'zero3' (fsdp_sharding_strategy SHARD_GRAD_OP or "
            "FULL_SHARD), or cpu_offload=False."
        )
    if offload_parameters and (engine != "deepspeed" or stage != "zero3"):
        raise ValueError(
            "offload_parameters=True is DeepSpeed's ZeRO-3 offload_param; with "
            f"engine={engine!r}, stage={stage!r} it does not apply. FSDP's cpu_offload "
            "already moves parameters: use cpu_offload=True with stage 'zero3'."
        )
    return group
