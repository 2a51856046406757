"""An app served by uvicorn on a thread of this process, on loopback: for tests and the load benchmark.

with BackgroundServer(build_app(llm, "name")) as server:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
"""

from __future__ import annotations

import socket
import threading
import time

import uvicorn


class BackgroundServer:
    def __init__(self, app, host: str = "127.0.0.1", start_timeout_s: float = 60.0) -> None:
        self._sock = socket.socket(socket.AF_INET)
        self._sock.bind((host, 0))
        self.host, self.port = self._sock.getsockname()[:2]
        self.url = f"http://{host}:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
        self._thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self._sock]}, name="deepinfer-serve", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + start_timeout_s
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server on {self.url} did not start")
            time.sleep(0.01)

    def stop(self, timeout_s: float = 60.0) -> None:
        """Shut down (the app's lifespan closes its engine) and wait for the thread."""
        self.server.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
