"""``lowlat serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over one engine loop.

Start order: the Engine (weights, KV pool, CUDA graphs; with ``--tp N`` rank 0 spawns the workers, which follow
its calls), the chat template, the engine loop thread, the lines saying which path serves, then uvicorn.
SIGTERM (or Ctrl-C): the engine loop refuses new requests (503), uvicorn stops listening and waits up to
``--shutdown-grace`` seconds for running requests, cancels the rest (their requests are aborted), the loop stops
and closes the engine, and the process exits 0.
"""

from __future__ import annotations

import argparse
import signal
import socket
import sys
from typing import Any

from lowlat.cli.errors import one_line_errors


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers``; sets ``func=serve``."""
    p = subparsers.add_parser(
        "serve", help="serve the model over an OpenAI-compatible HTTP API",
        description="Serve a model over the OpenAI API (/v1/completions, /v1/chat/completions, /v1/models) plus "
                    "/health and /metrics (Prometheus). Before listening it prints which path serves the model (the "
                    "plugin and why, or the general path and why), as lowlat run does; /v1/models lists it as "
                    "serving_path. Needs the serve extra: pip install 'lowlat[serve]' "
                    "(from a checkout: pip install -e 'core[serve]').")
    add_arguments(p)
    p.set_defaults(func=serve)
    return p


def add_arguments(p: argparse.ArgumentParser) -> None:
    from lowlat.cli.run import add_engine_arguments

    add_engine_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--served-model-name", default=None,
                   help="the model id clients send and /v1/models lists (default: the --model value)")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="jinja2 chat template to use instead of the checkpoint's (presets: a ChatML default)")
    p.add_argument("--max-queued-requests", type=int, default=256,
                   help="requests that may wait for a batch slot; more are answered 503 (default 256)")
    p.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds a request may take before it is aborted (504); a request's own 'timeout' field "
                        "may lower it (default 600)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="seconds running requests get to finish after SIGTERM (default 30)")
    p.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default warning)")


def check_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming the flag when a server flag is out of range."""
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_queued_requests < 1:
        raise ValueError(f"--max-queued-requests must be >= 1, got {args.max_queued_requests}")
    for flag in ("request_timeout", "shutdown_grace"):
        if not getattr(args, flag) > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {getattr(args, flag)}")


def _bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port. Raises ValueError naming the flag when it cannot be had."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"--host {host} --port {port}: cannot listen there ({e.strerror}); pick another --port "
                         "or stop what uses it") from None
    sock.set_inheritable(True)
    return sock


@one_line_errors("serve")
def serve(args: argparse.Namespace) -> int:
    """Run the server until SIGTERM / SIGINT. Returns 0 after a clean shutdown."""
    try:
        import uvicorn

        from lowlat.serve.app import ServeSettings, create_app
    except ImportError as e:
        raise RuntimeError(f"lowlat serve needs the serve extra ({e.name} is missing): "
                           "pip install 'lowlat[serve]', or from a lowlat checkout's root "
                           "pip install -e 'core[serve]'") from None
    from lowlat.cli.run import engine_config_from_args
    from lowlat.runtime import tp_launch
    from lowlat.runtime.engine import Engine
    from lowlat.runtime.model_runner import is_checkpoint_dir
    from lowlat.serve.chat_template import ChatTemplate
    from lowlat.serve.engine_loop import EngineLoop
    from lowlat.serve.metrics import ServeMetrics

    check_args(args)
    config = engine_config_from_args(args)
    sock = _bind(args.host, args.port)  # before the model loads: a busy port fails in a second, not minutes
    try:
        if config.tp_size > 1 and tp_launch.under_torchrun():
            raise ValueError("lowlat serve starts its own tensor-parallel workers; run it without torchrun "
                             f"(lowlat serve --tp {config.tp_size} ...)")
        template = ChatTemplate.load(config.model if is_checkpoint_dir(config.model) else None, args.chat_template)
        engine = Engine(config)
        metrics = ServeMetrics()
        loop = EngineLoop(engine, max_queued=args.max_queued_requests, metrics=metrics)
        name = args.served_model_name or args.model
        app = create_app(loop, ServeSettings(name, template, request_timeout_s=args.request_timeout), metrics)

        class Server(uvicorn.Server):
            def handle_exit(self, sig: int, frame: Any) -> None:
                loop.refuse_new()  # new requests get 503 at once; running ones go on within the grace period
                super().handle_exit(sig, frame)

        server = Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_grace,
                                       lifespan="off"))
        # uvicorn re-raises the signal it caught once it has shut down; a Python handler keeps that from killing
        # us (SIGTERM) or raising KeyboardInterrupt (SIGINT, Ctrl-C: exit 130) before the engine is closed, so a
        # drained shutdown exits 0 either way.
        previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
        loop.start()
        port = sock.getsockname()[1]
        path = loop.serving_path  # what lowlat run prints: the plugin and why, or the general path and why
        print("\n".join([f"lowlat serve: {path['summary']}", *(f"  auto skipped {s}" for s in path["skipped"])]),
              file=sys.stderr, flush=True)
        print(f"lowlat serve: {name} ({engine.model_config.architecture}) on http://{args.host}:{port}/v1 "
              f"(chat template: {template.origin}); Ctrl-C or SIGTERM stops", file=sys.stderr, flush=True)
        try:
            server.run(sockets=[sock])
        finally:
            loop.stop(grace_s=1.0)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    finally:
        sock.close()
    print("lowlat serve: stopped", file=sys.stderr, flush=True)
    return 0
