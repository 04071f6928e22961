"""Per-rank memory of parameters, gradients and optimizer state: DDP vs ZeRO-1/2/3, measured.

What is measured
----------------
A model of 8 equal blocks (``Block`` = ``Linear(1024, 1024)`` + ReLU; 8,396,800 parameters)
is trained for two steps with AdamW on 2 CPU processes (gloo), started by
``nbaccel.notebook_launcher`` and prepared by ``nbaccel.Accelerator`` in each row's config:

* **DDP**: ``strategy="ddp"``; **ZeRO-1**: plus ``shard_optimizer_state=True``
  (``ZeroRedundancyOptimizer``);
* **ZeRO-2** / **ZeRO-3**: ``strategy="fsdp"`` with ``fsdp_sharding_strategy`` SHARD_GRAD_OP /
  FULL_SHARD, each ``Block`` its own shard unit (``fsdp_transformer_layer_cls="Block"``);
* **FSDP NO_SHARD**; bf16 and fp16 rows (``mixed_precision``); CPU offload rows
  (``fsdp_cpu_offload=True``). On a CPU machine the device *is* host memory, so an offload
  row's estimate column is device + host, and its parts are checked against the same config
  without offload (offload moves bytes, it does not remove them). Where they go is not
  measurable here.
* accumulation rows (``gradient_accumulation_steps=2``, ``with acc.accumulate(model)``):
  gradients are also measured after the micro-step that does not sync, where FSDP keeps
  them unsharded in its own accumulators (read from FSDP2's internal ``FSDPParam`` objects,
  ``unsharded_accumulated_grad`` and the unsharded parameter's ``.grad``).

Each rank counts tensor storage bytes (process RSS is useless on CPU: glibc keeps freed
memory, FACTS.md), every storage once (by ``data_ptr``), a DTensor by its local shard:

* **params**: the storages of ``model.parameters()`` *and* of the optimizer's parameters
  (FSDP's fp32 shards), at rest and right after the forward; the larger. Right after the
  forward FSDP2 has swapped the gathered parameters onto the modules, so ZeRO-2's unsharded
  copy is seen there, while its shards live on in the optimizer;
* **grads**: ``p.grad`` of every parameter after each ``acc.backward`` (before
  ``zero_grad``), plus FSDP's unsharded gradient accumulators (see accumulation below);
* **optim**: every tensor in the optimizer's state after the step (ZeRO-1: the local
  ``optim.state`` of the ``ZeroRedundancyOptimizer``, i.e. this rank's partition);
* **buckets**: DDP's gradient buckets (its reducer's ``bucket_sizes``), which DDP keeps
  beside the gradients unless ``gradient_as_bucket_view=True``.

Each figure is the maximum over both steps and both ranks. The estimate is
``nbaccel.hardware.memory_estimate.estimate_for_config`` for the same ``Config`` and the parameter
count (the config panel's figure). The run fails (exit 1) if a total or any part differs from
the estimate by more than 10 % (parts under 1 % of the total excepted).

Usage::

    python benchmarks/sharding_memory.py            # every row, ~30 s
    python benchmarks/sharding_memory.py --rows 1,4 --blocks 4 --width 512
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Iterable
from typing import Any

WORLD_SIZE = 2
TOLERANCE = 0.10
MB = 1e6
FSDP = {"strategy": "fsdp", "fsdp_transformer_layer_cls": "Block"}
# row name -> config fields (flat names, as notebook_launcher takes them)
ROWS: dict[str, dict[str, Any]] = {
    "DDP": {"strategy": "ddp"},
    "ZeRO-1": {"strategy": "ddp", "shard_optimizer_state": True},
    "ZeRO-2": {**FSDP, "fsdp_sharding_strategy": "SHARD_GRAD_OP"},
    "ZeRO-3": {**FSDP, "fsdp_sharding_strategy": "FULL_SHARD"},
    "FSDP NO_SHARD": {**FSDP, "fsdp_sharding_strategy": "NO_SHARD"},
    "DDP bf16": {"strategy": "ddp", "mixed_precision": "bf16"},
    "ZeRO-2 bf16": {**FSDP, "fsdp_sharding_strategy": "SHARD_GRAD_OP", "mixed_precision": "bf16"},
    "ZeRO-3 bf16": {**FSDP, "fsdp_sharding_strategy": "FULL_SHARD", "mixed_precision": "bf16"},
    "ZeRO-3 fp16": {**FSDP, "fsdp_sharding_strategy": "FULL_SHARD", "mixed_precision": "fp16"},
    "ZeRO-1 fp16": {"strategy": "ddp", "shard_optimizer_state": True, "mixed_precision": "fp16"},
    "ZeRO-2 offload": {**FSDP, "fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_cpu_offload": True},
    "ZeRO-3 offload": {**FSDP, "fsdp_sharding_strategy": "FULL_SHARD", "fsdp_cpu_offload": True},
    "DDP accum 2": {"strategy": "ddp", "gradient_accumulation_steps": 2},
    "ZeRO-2 accum 2": {
        **FSDP,
        "fsdp_sharding_strategy": "SHARD_GRAD_OP",
        "gradient_accumulation_steps": 2,
    },
    "ZeRO-3 accum 2": {
        **FSDP,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "gradient_accumulation_steps": 2,
    },
    "ZeRO-3 bf16 accum 2": {
        **FSDP,
        "fsdp_sharding_strategy": "FULL_SHARD",
        "mixed_precision": "bf16",
        "gradient_accumulation_steps": 2,
    },
}
PARTS = ("params", "grads", "optim", "buckets")


# --------------------------------------------------------------------------- worker side


def storage_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (a DTensor: its local shard)."""
    import torch

    seen: dict[int, int] = {}
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        storage = local.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def ddp_bucket_bytes(model: Any) -> int:
    """Bytes of DDP's gradient buckets kept beside the gradients (0 when they are views)."""
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, DistributedDataParallel):
        return 0
    data = model._get_ddp_logging_data()  # type: ignore[no-untyped-call]
    if data.get("gradient_as_bucket_view"):
        return 0  # the gradients are the buckets: counted as gradients
    return sum(int(size) for size in str(data.get("bucket_sizes", "")).split(",") if size.strip())


def fsdp_unsharded_grads(model: Any) -> list[Any]:
    """Gradients FSDP2 accumulates unsharded while gradient sync is off (private API)."""
    found = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = get_state()._fsdp_param_group if get_state else None
        for fsdp_param in group.fsdp_params if group else ():
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            found.append(getattr(unsharded, "grad", None))
            found.append(getattr(fsdp_param, "unsharded_accumulated_grad", None))
    return found


def measure(blocks: int, width: int, batch: int, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps in this process's config; its peak bytes of each part."""
    import torch
    from torch import nn

    import nbaccel
    from nbaccel.hardware.memory_estimate import count_parameters

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(width, width)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.relu(self.linear(x))

    torch.manual_seed(0)  # FSDP2 does not broadcast initial weights: same seed everywhere
    model: Any = nn.Sequential(*[Block() for _ in range(blocks)])
    num_params = count_parameters(model)
    acc = nbaccel.Accelerator()
    optimizer: Any = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    inner = optimizer.optimizer  # the torch optimizer, or the ZeroRedundancyOptimizer
    local = getattr(inner, "optim", inner)  # ZeRO-1: the optimizer of this rank's partition
    x = torch.randn(batch, width, generator=torch.Generator().manual_seed(acc.process_index))

    def params() -> int:
        held = [p for group in inner.param_groups for p in group["params"]]
        return storage_bytes([*model.parameters(), *held])

    peak = dict.fromkeys(PARTS, 0)
    modules_only_after_forward = 0
    for _ in range(steps * acc.gradient_accumulation_steps):  # micro-steps
        with acc.accumulate(model):
            at_rest = params()
            out = model(x)
            after_forward = params()
            modules_only_after_forward = max(
                modules_only_after_forward, storage_bytes(model.parameters())
            )
            acc.backward(out.float().pow(2).mean())
            grads = storage_bytes(
                [*(p.grad for p in model.parameters()), *fsdp_unsharded_grads(model)]
            )
            optimizer.step()  # the prepared optimizer steps only when gradients synced
            state = storage_bytes(v for s in local.state.values() for v in s.values())
            optimizer.zero_grad()
        now = {
            "params": max(at_rest, after_forward),
            "grads": grads,
            "optim": state,
            "buckets": ddp_bucket_bytes(model),
        }
        peak = {part: max(peak[part], now[part]) for part in PARTS}
    return {
        **peak,
        "num_params": num_params,
        "modules_only": modules_only_after_forward,
        "kind": f"{acc.distributed_type.value}, {type(inner).__name__}, "
        f"{type(next(iter(model.parameters()))).__name__} parameters",
    }


# --------------------------------------------------------------------------- driver


def collect(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Per row, the element-wise maximum of both ranks' measurements, and the estimate."""
    import nbaccel
    from nbaccel.config.schema import Config
    from nbaccel.hardware.memory_estimate import estimate_for_config, sharding_stage

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="sharding_memory-") as runs_dir:
        for name in args.rows:
            print(f"{name} ...", file=sys.stderr, flush=True)
            fields = ROWS[name]
            run = nbaccel.launch(
                measure,
                args=(args.blocks, args.width, args.batch, args.steps),
                num_processes=WORLD_SIZE,
                runs_dir=runs_dir,
                **fields,
            )
            run.wait()
            ranks = run.results()
            measured = {part: max(r[part] for r in ranks.values()) for part in PARTS}
            rank0 = ranks[0]
            config = Config(num_processes=WORLD_SIZE).replace(**fields)
            estimate = estimate_for_config(config, rank0["num_params"])
            # Offload on CPU: the same bytes in the same memory; check the parts unoffloaded.
            unoffloaded = config.replace(fsdp_cpu_offload=False)
            results[name] = {
                "measured": measured,
                "estimate": estimate,
                "parts": estimate_for_config(unoffloaded, rank0["num_params"]),
                "stage": sharding_stage(config),
                "num_params": rank0["num_params"],
                "modules_only": max(r["modules_only"] for r in ranks.values()),
                "kind": rank0["kind"],
            }
    return results


def check(measured: dict[str, int], estimate: Any, parts: Any) -> list[str]:
    """The parts and total that differ from the estimate by more than the tolerance.

    ``parts``: the estimate whose parts are compared (without offload on CPU, see above).
    """
    expected = {
        "params": parts.parameters,
        "grads": parts.gradients,
        "optim": parts.optimizer_state,
        "buckets": parts.buffers,
    }
    total = sum(measured.values())
    whole = estimate.total + estimate.host  # on CPU the host is the device
    misses = []
    for part, want in [*expected.items(), ("total", whole)]:
        got = total if part == "total" else measured[part]
        small = part != "total" and max(got, want) < 0.01 * max(total, whole)
        if not small and abs(got - want) > TOLERANCE * max(want, 1):
            misses.append(f"{part} {got / MB:.2f} MB vs {want / MB:.2f} MB estimated")
    return misses


def format_report(results: dict[str, dict[str, Any]]) -> tuple[list[str], bool]:
    header = (
        f"{'row':<20}{'stage':<7}{'params':>8}{'grads':>8}{'optim':>8}{'buckets':>8}"
        f"{'total':>9}{'estimate':>10}{'ratio':>7}  "
    )
    lines = ["", header, "-" * len(header)]
    ok = True
    notes = []
    for name, row in results.items():
        m, e = row["measured"], row["estimate"]
        total, whole = sum(m.values()), e.total + e.host
        misses = check(m, e, row["parts"])
        ok = ok and not misses
        lines.append(
            f"{name:<20}{row['stage']:<7}"
            + "".join(f"{m[part] / MB:>8.2f}" for part in PARTS)
            + f"{total / MB:>9.2f}{whole / MB:>10.2f}{total / whole:>7.3f}  "
            + ("ok" if not misses else "MISS: " + "; ".join(misses))
        )
        if 0 < row["modules_only"] < m["params"]:
            notes.append(
                f"{name}: model.parameters() alone right after the forward: "
                f"{row['modules_only'] / MB:.2f} MB (the shards held by the optimizer add "
                f"{(m['params'] - row['modules_only']) / MB:.2f} MB)"
            )
    lines.append("")
    lines += [
        f"{name}, estimated: {row['estimate'].describe()}"
        for name, row in results.items()
        if row["estimate"].host
    ]
    lines += [f"{name}: {row['kind']}" for name, row in results.items()]
    lines += notes
    verdict = "PASS" if ok else "MISS"
    lines.append(f"every part within {TOLERANCE:.0%} of the estimate: {verdict}")
    return lines, ok


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8, help="Block count (8)")
    parser.add_argument("--width", type=int, default=1024, help="Linear width (1024)")
    parser.add_argument("--batch", type=int, default=16, help="samples per rank (16)")
    parser.add_argument("--steps", type=int, default=2, help="training steps (2)")
    numbered = ", ".join(f"{i} {name}" for i, name in enumerate(ROWS, 1))
    parser.add_argument("--rows", help=f"comma list of numbers (default all): {numbered}")
    args = parser.parse_args(argv)
    names = list(ROWS)
    picked = args.rows.split(",") if args.rows else range(1, len(names) + 1)
    args.rows = [names[int(number) - 1] for number in picked]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    results = collect(args)
    num_params = next(iter(results.values()))["num_params"]
    print(
        f"Per-rank memory of model states, {WORLD_SIZE} CPU processes (gloo), {args.blocks} x "
        f"Linear({args.width}, {args.width}) blocks = {num_params:,} parameters, AdamW, "
        f"{args.steps} steps; MB = 10^6 bytes, peak per part over steps and ranks "
        f"({time.perf_counter() - started:.0f} s in all)"
    )
    lines, ok = format_report(results)
    print("\n".join(lines))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
