"""``serving_while``: the helper's handler between two bytecodes, and the timer it leaves."""

from __future__ import annotations

import signal
import socket
import threading

from nbaccel.launcher.local.between_bytecodes import serving_while


def test_no_timer_is_left_armed_whatever_signal_comes_while_the_context_ends() -> None:
    # A SIGIO handled inside the context's own exit used to re-arm the timer after it was
    # disarmed: with SIGALRM back to its default, the helper died of the next tick. Here
    # the kernel's side writes without pause while the helper enters and leaves the
    # context, so signals keep landing in every part of its exit.
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    stop = threading.Event()

    def flood() -> None:
        while not stop.is_set():
            try:
                theirs.send(b"x")
            except BlockingIOError:
                pass

    def drain() -> None:
        try:
            while ours.recv(1 << 16):
                pass
        except BlockingIOError:
            pass

    writer = threading.Thread(target=flood, daemon=True)
    writer.start()
    previous = signal.getsignal(signal.SIGIO)
    try:
        for _ in range(2000):
            with serving_while(ours.fileno(), drain, 0.0005):
                drain()
            assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)
    finally:
        stop.set()
        writer.join(timeout=10)
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGIO, previous)
        ours.close()
        theirs.close()
