"""GPT-2 training step rate: a raw torch loop, nbaccel's Accelerator and Hugging Face Accelerate.

What is measured
----------------
One process, one device, the same model in every variant: GPT-2 124M built from
``GPT2Config()`` (no download), bf16 autocast, AdamW, batches of 16 x 1024 random tokens,
the loss computed by the model (``labels=input_ids``), as in a plain single-GPU script. With
``--device cpu`` a small GPT-2 (2 layers, 128 wide, 8 x 128 tokens) runs on the CPU instead:
the same loops, to find what a loop does beyond the raw one (``--size tiny``: 1 layer, 32
wide, 2 x 16 tokens, where Python's share of a step is largest). Dropout is off, so every variant
computes the same numbers from the same initial weights and batches.

* **raw**: ``with torch.autocast(...): loss = model(...).loss``, ``loss.backward()``,
  ``optimizer.step()``, ``optimizer.zero_grad()``; the batch moved by ``.to(device)``;
* **raw, batches on the device**: raw, its batches moved to the device before timing: what the
  copy of a batch from pageable memory costs, which waits for the device's queued work (the
  raw loop and both frameworks' prepared loaders do that copy in every step);
* **raw + fp32 outputs**: raw, with the model's outputs converted to fp32 after the forward
  as Accelerate (and nbaccel) do by default: the price of that conversion alone;
* **nbaccel**: ``nbaccel.Accelerator(mixed_precision="bf16")``, ``prepare``,
  ``accelerator.backward``, with the step-time breakdown switched on as in a launched worker
  (its windows go nowhere outside a launch: sending one every 0.5 s is not measured);
* **nbaccel, breakdown off**: the same, ``step_timer.enabled = False``;
* **accelerate**: the same code with ``accelerate.Accelerator(mixed_precision="bf16")``.

Every variant has its own model, optimizer and loader, built the same way. After
``--warmup`` steps each, the variants take turns in blocks of ``--block`` steps (order
rotated every round), each block timed between two device synchronisations: paired rounds
seconds apart cancel the drift of a shared machine (on the CPU, torch runs on one thread and
each block is timed in that thread's CPU time: waiting for a core on a loaded machine is left
out, the work is not). Per variant: the median time per step
over the rounds, its peak memory (``max_memory_allocated`` over its blocks, on CUDA), the
median over rounds of raw's block time divided by its block time ("vs raw", > 1 is faster),
and the same against Accelerate's block of the same round. "loss vs accelerate" is the
largest relative difference of the warm-up losses (same weights, same batches): 0 when the
numbers are Accelerate's.

Usage::

    python benchmarks/gpu_step_rate.py                        # CUDA, ~1.5 min on one H100
    python benchmarks/gpu_step_rate.py --device cpu           # small GPT-2 on the CPU
    python benchmarks/gpu_step_rate.py --device cpu --quick   # smoke run, seconds
    python benchmarks/gpu_step_rate.py --json out.json        # also write the figures
    python benchmarks/gpu_step_rate.py --device cpu --profile # where nbaccel's step goes
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

GOAL = 0.98  # nbaccel's step rate against the raw loop (issue 23)
VARIANTS = (
    "raw",
    "raw, batches on the device",
    "raw + fp32 outputs",
    "nbaccel",
    "nbaccel, breakdown off",
    "accelerate",
)
# size -> (GPT2Config keywords, batch, sequence length)
SIZES: dict[str, tuple[dict[str, int], int, int]] = {
    "gpt2": ({}, 16, 1024),  # GPT2Config()'s defaults: GPT-2 124M (the default on CUDA)
    "small": ({"n_layer": 2, "n_embd": 128, "n_head": 4, "vocab_size": 2048}, 8, 128),  # CPU
    # Python's share of a step at its largest: what a loop adds to the raw one shows most.
    "tiny": ({"n_layer": 1, "n_embd": 32, "n_head": 2, "vocab_size": 128}, 2, 16),
}
Step = Callable[[Any], torch.Tensor]


def build_model(size: str) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    keywords, _batch, sequence = SIZES[size]
    vocab = keywords.get("vocab_size", 50257)
    config = GPT2Config(
        **keywords,
        bos_token_id=vocab - 1,
        eos_token_id=vocab - 1,
        n_positions=max(sequence, keywords.get("n_positions", 1024)),
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def token_batches(size: str, steps: int) -> torch.utils.data.DataLoader[Any]:
    keywords, batch, sequence = SIZES[size]
    vocab = keywords.get("vocab_size", 50257)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (steps * batch, sequence), generator=generator)
    data = torch.utils.data.TensorDataset(ids)
    return torch.utils.data.DataLoader(data, batch_size=batch, drop_last=True)


def make_variant(name: str, device: str, steps: int, size: str) -> tuple[Step, Any]:
    """The step function of one variant and its batch iterator, freshly built."""
    model = build_model(size)
    loader = token_batches(size, steps)
    if name.startswith("raw"):
        target = torch.device(device)
        model = model.to(target)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        convert = name == "raw + fp32 outputs"
        if name == "raw, batches on the device":  # moved before timing: no copy in the step
            loader = [tuple(t.to(target) for t in batch) for batch in loader]  # type: ignore[assignment]

        def raw_step(batch: Any) -> torch.Tensor:
            (ids,) = batch
            ids = ids.to(target)
            with torch.autocast(target.type, dtype=torch.bfloat16):
                outputs = model(input_ids=ids, labels=ids)
            if convert:  # what Accelerate's convert_outputs_to_fp32 does to a ModelOutput
                for key, value in outputs.items():
                    if isinstance(value, torch.Tensor) and value.dtype == torch.bfloat16:
                        outputs[key] = value.float()
            loss: torch.Tensor = outputs["loss"]
            del outputs  # as `model(...).loss` drops them: not held through backward
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            return loss

        return raw_step, iter(loader)
    if name.startswith("nbaccel"):
        import nbaccel

        acc: Any = nbaccel.Accelerator(mixed_precision="bf16", cpu=device == "cpu")
        # On in every launched worker; here (no launch) switched on by hand.
        acc.strategy.step_timer.enabled = name == "nbaccel"
    else:
        import accelerate  # type: ignore[import-untyped]

        acc = accelerate.Accelerator(mixed_precision="bf16", cpu=device == "cpu")
    if str(acc.device.type) != device:
        raise RuntimeError(f"{name}: the Accelerator chose {acc.device}, not {device}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)

    def step(batch: Any) -> torch.Tensor:
        (ids,) = batch
        loss: torch.Tensor = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        return loss

    return step, iter(loader)


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def measure(
    device: str, size: str, names: list[str], warmup: int, rounds: int, block: int
) -> dict[str, Any]:
    """Per variant: seconds per block and round, warm-up losses, peak memory (CUDA)."""
    steps = warmup + rounds * block
    built = {name: make_variant(name, device, steps, size) for name in names}
    losses: dict[str, list[float]] = {}
    peaks: dict[str, int] = dict.fromkeys(names, 0)

    def run(name: str, count: int) -> list[torch.Tensor]:
        step, batches = built[name]
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()  # the benchmark's own counter: per variant
        out = [step(next(batches)) for _ in range(count)]
        if device == "cuda":
            peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
        return out

    for name in names:
        losses[name] = [float(loss.detach()) for loss in run(name, warmup)]
    seconds: dict[str, list[float]] = {name: [] for name in names}
    wall: dict[str, list[float]] = {name: [] for name in names}
    for turn in range(rounds):
        shift = turn % len(names)
        for name in names[shift:] + names[:shift]:
            synchronize(device)
            started, cpu_started = time.perf_counter(), time.thread_time()
            run(name, block)
            synchronize(device)
            wall[name].append(time.perf_counter() - started)
            seconds[name].append(
                wall[name][-1] if device == "cuda" else time.thread_time() - cpu_started
            )
    return {
        "seconds": seconds,
        "wall_seconds": wall,
        "losses": losses,
        "peak_bytes": peaks if device == "cuda" else {},
        "info": describe(device, size),
        "block": block,
    }


def describe(device: str, size: str) -> dict[str, str]:
    import accelerate
    import transformers

    info = {
        "torch": torch.__version__,
        "accelerate": accelerate.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = str(torch.version.cuda)
    else:
        info["clock"] = (
            "main-thread CPU time (torch on 1 thread: a loaded machine's waits left out)"
        )

    keywords, batch, sequence = SIZES[size]
    shape = ", ".join(f"{k} {v}" for k, v in keywords.items()) or "124M"
    info["model"] = f"GPT-2 ({shape}), batch {batch} x {sequence}, bf16 autocast"
    return info


def summarize(data: dict[str, Any]) -> dict[str, dict[str, float | None]]:
    """Per variant: ms/step (median), vs raw and vs accelerate (paired medians), peak GiB,
    and the warm-up losses' largest relative difference from Accelerate's."""
    seconds, block = data["seconds"], data["block"]
    rows: dict[str, dict[str, float | None]] = {}
    for name, times in seconds.items():
        row: dict[str, float | None] = {"ms_per_step": 1000 * statistics.median(times) / block}
        for peer, key in (("raw", "vs_raw"), ("accelerate", "vs_accelerate")):
            theirs = seconds.get(peer)
            row[key] = (
                statistics.median(t / m for t, m in zip(theirs, times, strict=True))
                if theirs
                else None
            )
        peak = data["peak_bytes"].get(name)
        row["peak_gib"] = peak / 2**30 if peak else None
        reference = data["losses"].get("accelerate")
        mine = data["losses"][name]
        row["loss_vs_accelerate"] = (
            max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(reference, mine, strict=True))
            if reference
            else None
        )
        rows[name] = row
    return rows


def format_table(rows: dict[str, dict[str, float | None]]) -> list[str]:
    def cell(value: float | None, pattern: str) -> str:
        return "—" if value is None else pattern.format(value)

    lines = [
        "| variant | ms/step | vs raw | vs accelerate | peak GiB | loss vs accelerate |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        lines.append(
            f"| {name} | {cell(row['ms_per_step'], '{:.2f}')} | {cell(row['vs_raw'], '{:.3f}')}"
            f" | {cell(row['vs_accelerate'], '{:.3f}')} | {cell(row['peak_gib'], '{:.2f}')}"
            f" | {cell(row['loss_vs_accelerate'], '{:.1e}')} |"
        )
    nbaccel = rows.get("nbaccel", {}).get("vs_raw")
    if nbaccel is not None:
        verdict = "met" if nbaccel >= GOAL else "NOT met"
        lines.append(f"\nGoal nbaccel >= {GOAL} x raw: {nbaccel:.3f} ({verdict}).")
    return lines


def profile(device: str, size: str, names: list[str], steps: int, out_dir: Path) -> None:
    """cProfile (Python calls per step) and a torch.profiler trace of each variant."""
    import cProfile
    import pstats

    out_dir.mkdir(parents=True, exist_ok=True)
    for name in names:
        step, batches = make_variant(name, device, 2 * steps + 2, size)
        for _ in range(steps):  # warm
            step(next(batches))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(steps):
            step(next(batches))
        profiler.disable()
        slug = name.replace(" ", "_").replace(",", "").replace("+", "plus")
        stats = pstats.Stats(profiler, stream=sys.stdout)
        print(f"\n== {name}: Python calls, {steps} steps (tottime) ==")
        stats.sort_stats("tottime").print_stats(18)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        with torch.profiler.profile(activities=activities) as trace:
            step(next(batches))
            step(next(batches))
        trace.export_chrome_trace(str(out_dir / f"{slug}.trace.json"))
        print(f"== {name}: torch ops, 2 steps ==")
        print(trace.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--size", choices=sorted(SIZES), help="default: gpt2 (cuda), small (cpu)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 warm-up steps, 3 rounds of 2")
    parser.add_argument("--json", type=Path, help="also write the raw figures and table here")
    parser.add_argument("--profile", type=Path, nargs="?", const=Path("step-profiles"))
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here: use --device cpu")
    size = args.size or ("gpt2" if args.device == "cuda" else "small")
    if args.device == "cpu":
        torch.set_num_threads(1)  # all of a step on the thread whose CPU time is measured
    if args.quick:
        args.warmup, args.rounds, args.block = 2, 3, 2
    with contextlib.suppress(ValueError):
        args.variants.remove("raw")
    names = ["raw", *args.variants]  # raw first: every ratio needs it
    if args.profile is not None:
        profile(args.device, size, names, args.block, args.profile)
        return 0
    data = measure(args.device, size, names, args.warmup, args.rounds, args.block)
    rows = summarize(data)
    lines = format_table(rows)
    info = ", ".join(f"{k} {v}" for k, v in data["info"].items())
    print(f"{info}; {args.rounds} rounds x {args.block} steps, {args.warmup} warm-up steps")
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({**data, "rows": rows, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
