"""The worker -> parent event framing over a pipe."""

from __future__ import annotations

import os
import threading

from nbaccel.events import EventWriter, FrameDecoder, RunState, encode_frame


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
