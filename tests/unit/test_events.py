"""The worker -> parent event framing over a pipe."""

from __future__ import annotations

import os
import threading

from nbaccel.events import RunState
from nbaccel.frames import EventWriter, FrameDecoder, encode_frame


def test_decoder_reassembles_frames_split_anywhere() -> None:
    messages = [{"kind": "metric", "step": i, "values": {"loss": i / 3}} for i in range(5)]
    data = b"".join(encode_frame(m) for m in messages)
    for chunk in (1, 3, 7, len(data)):
        decoder = FrameDecoder()
        out = []
        for i in range(0, len(data), chunk):
            out += decoder.feed(data[i : i + chunk])
        assert out == messages


def test_writer_is_safe_from_threads_and_handles_large_messages() -> None:
    read_fd, write_fd = os.pipe()
    writer = EventWriter(write_fd)
    big = {"kind": "result", "value": b"x" * 300_000}
    received: list[dict] = []

    def reader() -> None:
        decoder = FrameDecoder()
        while chunk := os.read(read_fd, 65536):
            received.extend(decoder.feed(chunk))

    thread = threading.Thread(target=reader)
    thread.start()
    senders = [threading.Thread(target=writer.send, args=(big,)) for _ in range(4)]
    for sender in senders:
        sender.start()
    for sender in senders:
        sender.join(timeout=30)
    writer.close()
    thread.join(timeout=30)
    os.close(read_fd)
    assert received == [big] * 4


def test_run_state_done() -> None:
    assert not RunState.RUNNING.done
    assert all(s.done for s in (RunState.SUCCEEDED, RunState.FAILED, RunState.CANCELLED))


def read_frames(read_fd: int, count: int, timeout: float) -> list[dict]:
    """Frames from the pipe until ``count`` arrived (or the timeout passed)."""
    import select
    import time

    decoder, out = FrameDecoder(), []
    deadline = time.monotonic() + timeout
    while len(out) < count:
        ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        out += decoder.feed(os.read(read_fd, 65536))
    return out


def test_batched_metrics_arrive_together_within_the_batch_interval() -> None:
    read_fd, write_fd = os.pipe()
    writer = EventWriter(write_fd, batch_seconds=0.2)
    metrics = [{"kind": "metric", "step": i} for i in range(5)]
    for metric in metrics:
        writer.send_batched(metric)
    # The first goes at once; the other four are held, then written by the flusher thread
    # with no further call from the worker.
    assert read_frames(read_fd, 5, timeout=10) == metrics
    writer.close()
    os.close(read_fd)


def test_an_immediate_message_first_writes_what_is_batched_and_close_flushes() -> None:
    read_fd, write_fd = os.pipe()
    writer = EventWriter(write_fd, batch_seconds=3600)  # the flusher would never be due
    writer.send_batched({"kind": "metric", "step": 0})
    writer.send_batched({"kind": "metric", "step": 1})
    writer.send({"kind": "result", "value": b""})
    writer.send_batched({"kind": "metric", "step": 2})
    writer.close()
    frames = read_frames(read_fd, 4, timeout=5)
    os.close(read_fd)
    assert [f.get("step", "result") for f in frames] == [0, 1, "result", 2]
