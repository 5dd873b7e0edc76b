"""A Starlette app served by uvicorn on a free local port, in a thread of the test
process: for clients that need a real socket (lm-eval, the benchmark tools)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from typing import Iterator


@contextlib.contextmanager
def uvicorn_thread(app, start_timeout_s: float = 30.0) -> Iterator[str]:
    """Serve `app` on 127.0.0.1 (a free port) until the block ends; yields the API base URL
    (http://127.0.0.1:PORT/v1). Fails the test if the server has not started within
    `start_timeout_s` seconds."""
    import uvicorn
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.time() + start_timeout_s
    while not server.started:
        assert time.time() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
