"""After training: kept workers (``keep_workers=True``) against a relaunch, the state dict into
the kernel, and ``workers.map`` in order, measured.

A transformers GPT-2 built from its config in the driver (7 layers, 768 wide, vocabulary
16,384, 128 positions: ~62 M fp32 parameters, ~250 MB; its state dict holds the tied
``lm_head.weight`` as a key of its own, ~300 MB of tensors), 2 CPU processes
(``use_cpu=True``, gloo), the driver playing the kernel (a plain process with torch and
transformers imported):

1. **Training returned -> first evaluation batch.** ``nbaccel.notebook_launcher(train,
   keep_workers=True)`` (two AdamW steps with nbaccel's ``Accelerator``; ``train`` returns the
   unwrapped model, ``result`` on each rank); from the moment it returns to the end of the
   first ``workers.run(evaluate_one_batch)`` (one no-grad forward of 8 x 64 tokens per rank).
   Against Accelerate's way, in the same rounds: the training function ends with
   ``Accelerator.save_model`` (safetensors), then a fresh ``accelerate.debug_launcher`` (2 CPU
   processes, forked from the driver) builds the model, loads the file, ``prepare``s it and
   evaluates the same batch: launcher returned -> the second launcher returned, with the save
   (timed on rank 0 inside training) added. For reference the interactive round trip
   (``workers.run(noop)``, median of 20) and the batch itself (timed on the ranks): the goal is
   "first evaluation <= the round trip plus the batch".
2. **The state dict into the kernel**, DDP (the default strategy) and FSDP2
   (``strategy="fsdp"``), each on the workers of one kept launch: ``workers.state_dict()``,
   bytes/s = the returned tensors' bytes / seconds (goal >= 5 GB/s), against the obvious
   alternative measured on the same workers: ``workers.run(get_state_dict)``, the
   ``Accelerator.get_state_dict`` of the prepared model returned by rank 0 as the call's reply
   (pickled, its tensors copied into shared memory). This machine's floor beside them: as many
   bytes cloned into fresh memory, and pwritten into a new memfd, in one process. Peak host
   memory while each runs, in separate calls from the timed ones (the sampling takes CPU): a
   thread reads every ~2 ms the driver's and both workers' ``RssAnon`` (``/proc/PID/status``)
   plus the machine's ``Shmem`` (``/proc/meminfo``): a memfd segment counts once there, mapped
   or not, while a process's PSS sees only the pages it has touched through a mapping (the
   ranks unmap the segment once written, the kernel maps lazily), and reading PSS walks every
   page (tens of ms); the sum of PSS (``/proc/PID/smaps_rollup``, every 10th sample) is shown
   beside it. Peak minus the value just before the call; other jobs' shared memory moves it.
   Goal: peak <= one full copy (the returned bytes) plus one shard (a copy / 2) above the
   baseline. The first call after training is kept apart (FSDP frees memory in it).
3. **``workers.map`` over 50,000 samples** (an MLP 256 -> 1024 -> 1024 -> 10 trained two
   steps, kept as ``result``; batches of 500, outputs in dataset order) against "the pass
   itself": ``workers.run`` of the same forward passes with the data pushed to the ranks before
   (untimed), each rank slicing its half (global batch b on rank b % 2), nothing gathered.
   ``map`` is timed with the dataset sent from the kernel (each call), and with it already on
   the ranks (``map("result", "data")``). Goal: map <= 1.2 x the pass.

Medians over ``--rounds``; in part 1 the two ways alternate which goes first. On a shared
2-core machine the load moves everything: the ratios within a round are the figures to read.

Usage::

    python benchmarks/after_training.py             # 3 rounds: ~4 min
    python benchmarks/after_training.py --rounds 1  # smoke run
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch
import transformers
from bench_util import median, progress, verdict

import nbaccel

GPT = {"n_layer": 7, "n_embd": 768, "n_head": 12, "vocab_size": 16384, "n_positions": 128}
CONFIG = transformers.GPT2Config(**GPT, bos_token_id=0, eos_token_id=0)  # built in the driver
TRAIN = {"steps": 2, "batch": 2, "seq": 32}
EVAL = {"batch": 8, "seq": 64}
MLP = {"inputs": 256, "hidden": 1024, "classes": 10, "samples": 50_000, "batch": 500}
LAUNCH: dict[str, Any] = {"num_processes": 2, "use_cpu": True, "dashboard": False}
GOAL_BANDWIDTH, GOAL_MAP = 5e9, 1.2
TRIPS = 20  # round trips per round


# --------------------------------------------------------------------------- on the ranks


def _steps(acc: Any) -> tuple[Any, Any]:
    """The same few AdamW steps under either framework's Accelerator: the prepared model
    and the last loss."""
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(TRAIN["steps"]):
        ids = torch.randint(0, GPT["vocab_size"], (TRAIN["batch"], TRAIN["seq"]))
        loss = model(input_ids=ids, labels=ids).loss
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return model, loss


def train_gpt(spec: dict[str, Any]) -> Any:
    """nbaccel's Accelerator, a few AdamW steps; returns the unwrapped model (DDP), or the
    last loss (``spec["model"]`` false: the state dict is found through the Accelerator)."""
    from nbaccel import Accelerator

    acc = Accelerator()
    model, loss = _steps(acc)
    return acc.unwrap_model(model) if spec.get("model") else float(loss.detach())


def eval_ids(rank: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1 + rank)
    return torch.randint(0, GPT["vocab_size"], (EVAL["batch"], EVAL["seq"]), generator=generator)


def evaluate_one_batch() -> dict[str, float]:
    """On a kept rank: one no-grad forward of the trained model (``result``)."""
    import time

    import torch
    import torch.distributed as dist

    started = time.perf_counter()
    model = result  # noqa: F821 - the rank's namespace: what train returned
    model.eval()
    with torch.no_grad():
        loss = model(input_ids=eval_ids(dist.get_rank()), labels=eval_ids(dist.get_rank())).loss
    return {"loss": loss.item(), "batch": time.perf_counter() - started}


def noop() -> None:
    return None


def state_dict_as_reply() -> Any:
    """The alternative: the prepared model's ``get_state_dict`` (every rank: a collective under
    FSDP), rank 0's returned as the call's reply. ``accelerator``: the kept rank's last
    Accelerator; its first prepared model is the one ``workers.state_dict()`` takes."""
    import torch.distributed as dist

    acc = accelerator  # noqa: F821 - the rank's namespace
    state = acc.get_state_dict(acc._prepared.models[0])
    return state if dist.get_rank() == 0 else None


def accelerate_train(folder: str, out: str) -> None:
    """Accelerate's way: the same steps, then ``save_model`` (safetensors) to ``folder``."""
    import accelerate

    acc = accelerate.Accelerator()
    model, _ = _steps(acc)
    started = time.perf_counter()
    acc.wait_for_everyone()
    acc.save_model(model, folder)
    acc.wait_for_everyone()
    if acc.is_main_process:
        Path(out).write_text(json.dumps({"save": time.perf_counter() - started}))


def accelerate_evaluate(folder: str, out: str) -> None:
    """A fresh launch: build the model, load the saved file, prepare, evaluate one batch."""
    import accelerate
    import safetensors.torch

    started = time.perf_counter()
    acc = accelerate.Accelerator()
    model = transformers.GPT2LMHeadModel(CONFIG)
    safetensors.torch.load_model(model, os.path.join(folder, "model.safetensors"))
    model = acc.prepare(model)
    loaded = time.perf_counter()
    model.eval()
    with torch.no_grad():
        ids = eval_ids(acc.process_index)
        loss = model(input_ids=ids, labels=ids).loss.item()
    if acc.is_main_process:
        found = {"build_load": loaded - started, "batch": time.perf_counter() - loaded}
        Path(out).write_text(json.dumps({**found, "loss": loss}))


def train_mlp() -> Any:
    """A few SGD steps of the MLP; returns it unwrapped (``result``)."""
    import torch

    from nbaccel import Accelerator

    acc = Accelerator()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(MLP["inputs"], MLP["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["classes"]),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = acc.prepare(model, optimizer)
    for _ in range(2):
        x = torch.randn(32, MLP["inputs"])
        loss = model(x).pow(2).mean()
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return acc.unwrap_model(model)


def rank_pass() -> int:
    """The pass itself: this rank's batches of the pushed ``data`` (global batch b on rank
    b % world, as map splits), forward under inference_mode, nothing gathered."""
    import torch
    import torch.distributed as dist

    rank, world, size = dist.get_rank(), dist.get_world_size(), MLP["batch"]
    model, x = result, data  # noqa: F821 - the rank's namespace
    model.eval()
    rows = 0
    with torch.inference_mode():
        for start in range(rank * size, len(x), world * size):
            rows += len(model(x[start : start + size]))
    return rows


# --------------------------------------------------------------------------- memory


def _status(pid: int) -> int:
    """RssAnon of ``pid``, bytes (a counter: cheap to read every few ms)."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def _pss(pid: int) -> int:
    """Pss of ``pid``, bytes (a walk of its pages: tens of ms for a big process)."""
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    return 0


def _machine_shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def memory_now(pids: list[int]) -> int:
    """The processes' anonymous memory plus the machine's shared memory (a memfd segment
    counts once, mapped or not; file pages, unchanged by these calls, are left out)."""
    return sum(_status(pid) for pid in pids) + _machine_shmem()


def pss_now(pids: list[int]) -> int:
    return sum(_pss(pid) for pid in pids)


class Sampler(threading.Thread):
    """Peak of ``memory_now`` every ``every`` s, and of ``pss_now`` every ``PSS_EVERY``-th
    sample, until ``stop()``."""

    PSS_EVERY = 10

    def __init__(self, pids: list[int], every: float = 0.002) -> None:
        super().__init__(daemon=True)
        self.pids, self.every = pids, every
        self.peak, self.peak_pss, self.samples, self.pss_samples = 0, 0, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        while True:
            stopping = self._stop_event.is_set()  # one last sample after the call
            self.peak = max(self.peak, memory_now(self.pids))
            if self.samples % self.PSS_EVERY == 0:
                self.peak_pss = max(self.peak_pss, pss_now(self.pids))
                self.pss_samples += 1
            self.samples += 1
            if stopping:
                return
            self._stop_event.wait(self.every)

    def stop(self) -> None:
        self._stop_event.set()
        self.join()


def tensor_bytes(state: Any) -> int:
    return sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v))


def collect() -> None:
    gc.collect()
    time.sleep(0.2)  # the segments' last views unmapped


# --------------------------------------------------------------------------- 1. evaluation


def nbaccel_first_eval() -> dict[str, Any]:
    nbaccel.notebook_launcher(train_gpt, args=({"model": True},), keep_workers=True, **LAUNCH)
    returned = time.perf_counter()
    workers = nbaccel.last_workers()
    first = workers.run(evaluate_one_batch)
    first_s = time.perf_counter() - returned
    started = time.perf_counter()
    second = workers.run(evaluate_one_batch)
    again = time.perf_counter() - started
    trips = []
    for _ in range(TRIPS):
        started = time.perf_counter()
        workers.run(noop)
        trips.append(time.perf_counter() - started)
    workers.close()
    batch = max(value["batch"] for value in first.values())
    again_batch = max(value["batch"] for value in second.values())
    return {
        "first": first_s, "again": again, "trip": median(trips), "batch": batch,
        "again_over": again - again_batch,
    }  # fmt: skip


def accelerate_first_eval(scratch: Path, index: int) -> dict[str, Any]:
    import accelerate

    folder, saved, evaluated = (scratch / f"acc{index}{x}" for x in ("", ".save", ".eval"))
    accelerate.debug_launcher(accelerate_train, args=(str(folder), str(saved)), num_processes=2)
    returned = time.perf_counter()
    accelerate.debug_launcher(
        accelerate_evaluate, args=(str(folder), str(evaluated)), num_processes=2
    )
    relaunch = time.perf_counter() - returned
    found = {**json.loads(saved.read_text()), **json.loads(evaluated.read_text())}
    return {**found, "relaunch": relaunch, "total": relaunch + found["save"]}


def first_evaluation(scratch: Path, rounds: int) -> dict[str, list[dict[str, Any]]]:
    found: dict[str, list[dict[str, Any]]] = {"nbaccel": [], "accelerate": []}
    for index in range(rounds):
        order = ["nbaccel", "accelerate"] if index % 2 == 0 else ["accelerate", "nbaccel"]
        for way in order:
            progress(f"1. round {index + 1}/{rounds}: {way} (load {os.getloadavg()[0]:.1f})")
            if way == "nbaccel":
                found[way].append(nbaccel_first_eval())
            else:
                found[way].append(accelerate_first_eval(scratch, index))
    return found


# --------------------------------------------------------------------------- 2. state dict


def one_state_call(workers: Any, way: str, sampled: bool) -> dict[str, Any]:
    pids = [os.getpid(), *workers.pids.values()]
    collect()
    baseline, baseline_pss = memory_now(pids), pss_now(pids)
    sampler = Sampler(pids) if sampled else None
    if sampler is not None:
        sampler.start()
    started = time.perf_counter()
    call = (
        workers.state_dict if way == "state_dict" else lambda: workers.run(state_dict_as_reply)[0]
    )
    state = call()
    seconds = time.perf_counter() - started
    if sampler is not None:
        sampler.stop()
    held = memory_now(pids) - baseline
    found = {"seconds": seconds, "bytes": tensor_bytes(state), "keys": len(state), "held": held}
    found["tied"] = _aliased(state)
    if sampler is not None:
        found |= {"peak": sampler.peak - baseline, "peak_pss": sampler.peak_pss - baseline_pss}
        found |= {"samples": sampler.samples, "pss_samples": sampler.pss_samples}
    del state
    collect()
    return found


def _aliased(state: dict[str, Any]) -> bool:
    """Whether the tied embedding and head share their memory in the returned dict."""
    head, wte = state.get("lm_head.weight"), state.get("transformer.wte.weight")
    return head is not None and wte is not None and head.data_ptr() == wte.data_ptr()


def floor(size: int, rounds: int) -> dict[str, float]:
    """This machine's floor for ``size`` bytes into fresh memory, in one process: a tensor
    cloned, and pwritten into a new memfd (4 KiB pages; the ranks write through a mapping
    on huge pages)."""
    source = torch.randn(size // 4)
    clones, writes = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        copy = source.clone()
        clones.append(time.perf_counter() - started)
        del copy
        fd = os.memfd_create("after-training-floor")
        try:
            os.ftruncate(fd, size)
            view, done = memoryview(source.numpy()).cast("B"), 0
            started = time.perf_counter()
            while done < len(view):
                done += os.pwrite(fd, view[done:], done)
            writes.append(time.perf_counter() - started)
        finally:
            os.close(fd)
    return {"clone": size / median(clones), "pwrite": size / median(writes)}


def state_dicts(rounds: int) -> dict[str, dict[str, list[dict[str, Any]]]]:
    found: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for strategy in ("ddp", "fsdp"):
        options = {} if strategy == "ddp" else {"strategy": "fsdp"}
        progress(f"2. {strategy}: training, kept workers")
        nbaccel.notebook_launcher(train_gpt, args=({},), keep_workers=True, **LAUNCH, **options)
        workers = nbaccel.last_workers()
        ways: dict[str, list[dict[str, Any]]] = {"state_dict": [], "reply": []}
        progress(f"2. {strategy}: the first call after training, each way (untimed rounds)")
        firsts = {way: one_state_call(workers, way, sampled=True) for way in ways}
        for index in range(rounds):
            progress(f"2. {strategy} round {index + 1}/{rounds} (load {os.getloadavg()[0]:.1f})")
            order = list(ways) if index % 2 == 0 else list(ways)[::-1]
            for way in order:
                timed = one_state_call(workers, way, sampled=False)
                sampled = one_state_call(workers, way, sampled=True)
                ways[way].append({**timed, **{k: v for k, v in sampled.items() if "peak" in k}})
                ways[way][-1] |= {k: sampled[k] for k in ("samples", "pss_samples")}
        workers.close()
        found[strategy] = {**ways, "first": firsts}  # type: ignore[dict-item]
    return found


# --------------------------------------------------------------------------- 3. map


def map_in_order(rounds: int) -> dict[str, Any]:
    progress("3. the MLP: training, kept workers")
    nbaccel.notebook_launcher(train_mlp, keep_workers=True, **LAUNCH)
    workers = nbaccel.last_workers()
    torch.manual_seed(1)
    data = torch.randn(MLP["samples"], MLP["inputs"])
    workers.push(data=data)
    size = MLP["batch"]
    # Correct: the rows in dataset order, equal to the same model's forward here.
    outputs = workers.map("result", data, batch_size=size)
    here = torch.nn.Sequential(
        torch.nn.Linear(MLP["inputs"], MLP["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["hidden"]),
        torch.nn.ReLU(),
        torch.nn.Linear(MLP["hidden"], MLP["classes"]),
    )
    nbaccel.load_into(here, workers.state_dict("result"))
    with torch.inference_mode():
        correct = bool(torch.allclose(outputs, here(data), atol=1e-5))
    shape = tuple(outputs.shape)
    del outputs
    times: dict[str, list[float]] = {"pass": [], "map sent": [], "map on ranks": []}
    for index in range(rounds):
        progress(f"3. round {index + 1}/{rounds} (load {os.getloadavg()[0]:.1f})")
        names = list(times)[index % 3 :] + list(times)[: index % 3]
        for name in names:
            started = time.perf_counter()
            if name == "pass":
                rows = sum(workers.run(rank_pass).values())
                assert rows >= MLP["samples"], rows
            else:
                source = data if name == "map sent" else "data"
                workers.map("result", source, batch_size=size)
            times[name].append(time.perf_counter() - started)
    workers.close()
    return {"times": times, "correct": correct, "shape": shape}


# --------------------------------------------------------------------------- the report


def row(what: str, value: str, ratio: str = "", goal: str = "", ok: bool | None = None) -> str:
    return f"{what:<58}{value:>10}{ratio:>9}  {goal:<22}{'' if ok is None else verdict(ok)}"


def mb(value: float) -> str:
    return f"{value / 1e6:.0f} MB"


def report(first: dict, states: dict, mapped: dict, floors: dict, model_bytes: int) -> list[str]:
    lines = [row("measure", "median", "ratio", "goal"), "-" * 105]
    ours, theirs = first["nbaccel"], first["accelerate"]
    first_s = median([f["first"] for f in ours])
    trip, batch = median([f["trip"] for f in ours]), median([f["batch"] for f in ours])
    ratio = median([f["first"] / (f["trip"] + f["batch"]) for f in ours])
    acc_total = median([f["total"] for f in theirs])
    lines += [
        row("1. kept: launcher returned -> first eval batch done, s", f"{first_s:.3f}",
            f"{ratio:.3f}x", "<= round trip + batch", ratio <= 1.0),
        row("   the batch itself (on the ranks, slower rank), s", f"{batch:.3f}"),
        row("   interactive round trip workers.run(noop), s", f"{trip:.4f}"),
        row("   first call less the batch, s",
            f"{median([f['first'] - f['batch'] for f in ours]):.3f}"),
        row("   the second eval call, s", f"{median([f['again'] for f in ours]):.3f}"),
        row("   the second call less its batch, s",
            f"{median([f['again_over'] for f in ours]):.3f}"),
        row("1. accelerate: save_model + fresh debug_launcher eval, s", f"{acc_total:.3f}",
            f"{median([o['first'] / t['total'] for o, t in zip(ours, theirs, strict=True)]):.3f}x",
            "(kept / it)"),
        row("   its save_model (rank 0, inside training), s",
            f"{median([f['save'] for f in theirs]):.3f}"),
        row("   launcher returned -> eval launcher returned, s",
            f"{median([f['relaunch'] for f in theirs]):.3f}"),
        row("   in it: build + load + prepare (rank 0), s",
            f"{median([f['build_load'] for f in theirs]):.3f}"),
        row("   in it: the batch (rank 0), s", f"{median([f['batch'] for f in theirs]):.3f}"),
    ]  # fmt: skip
    for strategy, ways in states.items():
        sd, alt = ways["state_dict"], ways["reply"]
        size = sd[0]["bytes"]
        goal_bytes = size + size / LAUNCH["num_processes"]
        rate = median([s["bytes"] / s["seconds"] for s in sd])
        alt_rate = median([s["bytes"] / s["seconds"] for s in alt])
        peak, alt_peak = median([s["peak"] for s in sd]), median([s["peak"] for s in alt])
        lines += [
            row(f"2. {strategy}: workers.state_dict(), GB/s", f"{rate / 1e9:.2f}",
                f"{rate / alt_rate:.2f}x", f">= {GOAL_BANDWIDTH / 1e9:g} GB/s",
                rate >= GOAL_BANDWIDTH),
            row("   its seconds (first call after training)",
                f"{median([s['seconds'] for s in sd]):.3f}",
                f"({ways['first']['state_dict']['seconds']:.3f})"),
            row("   its peak host memory above before the call", mb(peak),
                f"{peak / size:.2f}x", f"<= {mb(goal_bytes)} (1.5x)", peak <= goal_bytes),
            row("   (sum of PSS alone: peak above before)",
                mb(median([s["peak_pss"] for s in sd]))),
            row("   held after the call (the dict in the kernel)",
                mb(median([s["held"] for s in sd]))),
            row(f"2. {strategy}: workers.run(get_state_dict) reply, GB/s",
                f"{alt_rate / 1e9:.2f}"),
            row("   its seconds (first call after training)",
                f"{median([s['seconds'] for s in alt]):.3f}",
                f"({ways['first']['reply']['seconds']:.3f})"),
            row("   its peak host memory above before the call", mb(alt_peak),
                f"{alt_peak / size:.2f}x"),
            row("   (sum of PSS alone: peak above before)",
                mb(median([s["peak_pss"] for s in alt]))),
        ]  # fmt: skip
    lines += [
        row("2. floor here: clone of as many bytes, GB/s", f"{floors['clone'] / 1e9:.2f}"),
        row("2. floor here: pwrite into a fresh memfd, GB/s", f"{floors['pwrite'] / 1e9:.2f}"),
    ]
    times = mapped["times"]
    for name in ("map sent", "map on ranks"):
        ratios = [m / p for m, p in zip(times[name], times["pass"], strict=True)]
        label = "dataset sent each call" if name == "map sent" else 'dataset on ranks ("data")'
        lines.append(row(f"3. workers.map, {label}, s", f"{median(times[name]):.3f}",
                         f"{median(ratios):.2f}x", f"<= {GOAL_MAP}x the pass",
                         median(ratios) <= GOAL_MAP))  # fmt: skip
    lines.append(
        row(
            "   the pass itself: workers.run, each rank its half, s", f"{median(times['pass']):.3f}"
        )
    )
    ddp = states["ddp"]["state_dict"][0]
    lines += [
        "details:",
        f"  model: {model_bytes / 1e6:.0f} MB of unique fp32 parameters; the state dict "
        f"returned {ddp['keys']} keys, {ddp['bytes'] / 1e6:.0f} MB of tensors; the tied "
        f"lm_head.weight and transformer.wte.weight share memory there: {ddp['tied']}",
    ]
    for way, found in first.items():
        rounded = [{k: round(v, 3) for k, v in f.items()} for f in found]
        lines.append(f"  1. {way} per round: {rounded}")
    for strategy, ways in states.items():
        for way in ("state_dict", "reply"):
            found, one = ways[way], ways["first"][way]
            lines.append(
                f"  2. {strategy} {way}: s {[round(s['seconds'], 3) for s in found]}, peak MB "
                f"{[round(s['peak'] / 1e6) for s in found]}, PSS peak MB "
                f"{[round(s['peak_pss'] / 1e6) for s in found]}, held after MB "
                f"{[round(s['held'] / 1e6) for s in found]}, samples "
                f"{[(s['samples'], s['pss_samples']) for s in found]}; first call after "
                f"training: {one['seconds']:.3f} s, peak {one['peak'] / 1e6:.0f} MB, held "
                f"after {one['held'] / 1e6:.0f} MB"
            )
    rounded_times = {k: [round(x, 3) for x in v] for k, v in times.items()}
    lines.append(
        f"  3. map output {mapped['shape']}, equal to the kernel's forward of the same "
        f"weights: {mapped['correct']}; s per round {rounded_times}"
    )
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of every measure")
    args = parser.parse_args()
    started, load = time.perf_counter(), os.getloadavg()[0]
    model = transformers.GPT2LMHeadModel(CONFIG)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    with tempfile.TemporaryDirectory(prefix="after-training-") as folder:
        scratch = Path(folder)
        LAUNCH["runs_dir"] = str(scratch / "runs")
        first = first_evaluation(scratch, args.rounds)
        states = state_dicts(args.rounds)
        mapped = map_in_order(args.rounds)
        progress("2. the floor: as many bytes into fresh memory, in this process")
        floors = floor(states["ddp"]["state_dict"][0]["bytes"], max(args.rounds, 3))
    print(
        f"After training: GPT-2 {GPT['n_layer']} layers x {GPT['n_embd']}, vocabulary "
        f"{GPT['vocab_size']} ({model_bytes / 4e6:.1f} M fp32 params), 2 CPU processes; "
        f"torch {torch.__version__}, transformers {transformers.__version__}; "
        f"{os.cpu_count()} CPUs, load average before {load:.2f}, after "
        f"{os.getloadavg()[0]:.2f}; {args.rounds} rounds, {time.perf_counter() - started:.0f} s"
    )
    print("\n".join(report(first, states, mapped, floors, model_bytes)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
