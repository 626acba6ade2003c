"""Worker services in threads of the test process: serve_forever on its own thread, stopped,
joined and closed when the block (or fixture) ends, whatever happened in it."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager


@contextmanager
def serving() -> Iterator[Callable]:
    """Yields run(server) -> server.address: each server given serves on a daemon thread until
    the block ends; then every one is stopped (in start order), its thread joined, it is closed."""
    started = []

    def run(server):
        stop = threading.Event()
        t = threading.Thread(target=server.serve_forever, args=(stop,), daemon=True)
        t.start()
        started.append((server, stop, t))
        return server.address

    try:
        yield run
    finally:
        for server, stop, t in started:
            stop.set()
            t.join(5)
            server.close()
