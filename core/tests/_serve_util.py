"""An in-process lowlat server on 127.0.0.1 (a free port) for the serve tests: tiny-llama on CPU."""

from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager

from lowlat.config import EngineConfig
from lowlat.runtime import Engine
from lowlat.serve.app import ServeSettings, create_app
from lowlat.serve.chat_template import ChatTemplate
from lowlat.serve.engine_loop import EngineLoop
from lowlat.serve.metrics import ServeMetrics

MODEL = "tiny-llama"
START_TIMEOUT_S = 30.0


class Slow:
    """Seconds each forward sleeps (0 by default), so a test can hold requests running."""

    s = 0.0


@contextmanager
def running_server(*, max_queued: int = 2, request_timeout_s: float = 60.0, **engine_kw):
    import uvicorn

    kw = {"device": "cpu", "max_context_len": 256, "max_batch_size": 2, "page_size": 4, "cuda_graph": False,
          **engine_kw}
    engine = Engine(EngineConfig(model=MODEL, **kw))
    slow = Slow()
    forward = engine.runner.forward

    def slowed(batch, **kw):
        if slow.s:
            time.sleep(slow.s)
        return forward(batch, **kw)

    engine.runner.forward = slowed
    metrics = ServeMetrics()
    loop = EngineLoop(engine, max_queued=max_queued, metrics=metrics)
    app = create_app(loop, ServeSettings(MODEL, ChatTemplate.load(None), request_timeout_s=request_timeout_s),
                     metrics)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off",
                                           timeout_graceful_shutdown=2))
    loop.start()
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", loop, engine, slow
    finally:
        slow.s = 0.0
        server.should_exit = True
        thread.join(10)
        loop.stop(grace_s=1.0)
        sock.close()


def wait_for(pred, timeout_s: float = 10.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
