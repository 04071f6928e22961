"""What a call of interactive workers costs in a real Jupyter kernel, with its display.

What is measured
----------------
A kernel (jupyter_client, the venv's ipykernel) makes ``nbaccel.Workers(num_processes=2)``
once with ``dashboard="text"`` and once with the widget dashboard (``dashboard=True``), then,
for each, runs cells of ``--calls`` calls in a loop and reads every iopub message of each:

* **quiet**: ``workers.run(quiet)``, a function that prints nothing, logs nothing, returns 1;
* **talks**: ``workers.run(talks)``, which prints one line (its output must show).

Per call: the cell's wall time divided by ``--calls`` (the median of ``--repeats`` cells,
after two warm-up cells), and the display messages the cell sent (``display_data`` and
``update_display_data``; widget messages, ``comm_open``/``comm_msg``, counted beside them).
The kernel's own round trip (an empty loop) is taken from the cell times, so the figure is
the call's. The goal line: a quiet call with the widget dashboard costs what it costs with
text (at most 1.5x) and sends no display message.

Run: ``python benchmarks/interactive_call_display.py [--calls 20] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import queue
import statistics
import tempfile
import time
from typing import Any

from bench_util import verdict
from jupyter_client import BlockingKernelClient, KernelManager

SETUP = """
%load_ext nbaccel
import nbaccel
workers = nbaccel.Workers(num_processes=2, runs_dir={runs!r}, dashboard={dashboard!r})


def quiet():
    return 1


def talks():
    print("a line from the call")
    return 2
"""
LOOP = "import time\n_t = time.perf_counter()\nfor _ in range({calls}):\n    workers.run({fn})\n"
LOOP += "time.perf_counter() - _t"
EMPTY = "import time\n_t = time.perf_counter()\nfor _ in range({calls}):\n    pass\n"
EMPTY += "time.perf_counter() - _t"
DISPLAY = ("display_data", "update_display_data")
WIDGET = ("comm_open", "comm_msg")


def run(kc: BlockingKernelClient, code: str, timeout: float = 300) -> list[dict[str, Any]]:
    """Run ``code``; the iopub messages it caused (an error raises)."""
    msg_id = kc.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        if time.monotonic() > deadline:
            raise TimeoutError(f"the cell did not end within {timeout} s")
        try:
            msg = kc.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "error":
            raise RuntimeError("\n".join(msg["content"]["traceback"]))
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return messages
        messages.append(msg)


def seconds_of(messages: list[dict[str, Any]]) -> float:
    result = [m for m in messages if m["msg_type"] == "execute_result"]
    return float(result[0]["content"]["data"]["text/plain"])


def measure(
    dashboard: str | bool, calls: int, repeats: int
) -> dict[str, tuple[float, float, float]]:
    """{fn: (ms per call, display messages per call, widget messages per call)}."""
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=tempfile.mkdtemp(prefix="nbaccel-bench-"))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        run(kc, SETUP.format(runs=tempfile.mkdtemp(prefix="nbaccel-runs-"), dashboard=dashboard))
        empty = statistics.median(
            seconds_of(run(kc, EMPTY.format(calls=calls))) for _ in range(repeats)
        )
        figures = {}
        for fn in ("quiet", "talks"):
            for _ in range(2):
                run(kc, LOOP.format(calls=calls, fn=fn))  # warm: imports, plots, the pool
            times, shown, widgets = [], [], []
            for _ in range(repeats):
                messages = run(kc, LOOP.format(calls=calls, fn=fn))
                times.append(seconds_of(messages) - empty)
                shown.append(sum(m["msg_type"] in DISPLAY for m in messages))
                widgets.append(sum(m["msg_type"] in WIDGET for m in messages))
            figures[fn] = (
                statistics.median(times) / calls * 1000,
                statistics.median(shown) / calls,
                statistics.median(widgets) / calls,
            )
        run(kc, "workers.close()")
        return figures
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    results = {mode: measure(mode, args.calls, args.repeats) for mode in ("text", True)}
    print(f"{'display':<8} {'call':<6} {'ms/call':>8} {'display msgs/call':>18}", end="")
    print(f" {'widget msgs/call':>17}")
    for mode, figures in results.items():
        name = "text" if mode == "text" else "widgets"
        for fn, (ms, shown, widgets) in figures.items():
            print(f"{name:<8} {fn:<6} {ms:>8.2f} {shown:>18.2f} {widgets:>17.2f}")
    text_ms, widget_ms = results["text"]["quiet"][0], results[True]["quiet"][0]
    ratio = widget_ms / text_ms
    quiet_shown = results[True]["quiet"][1] + results[True]["quiet"][2]
    ok = verdict(ratio <= 1.5 and quiet_shown == 0)
    print(f"goal: a quiet call with widgets {ratio:.2f}x its text cost (<= 1.5x), ", end="")
    print(f"{quiet_shown:g} display messages (0): {ok}")


if __name__ == "__main__":
    main()
