"""``minirad serve``: the model behind an OpenAI-compatible HTTP server
(:mod:`minirad.entrypoints.openai.api_server`), as ``vllm serve``; with ``--kv-events-*``, the
radix tree's blocks published as vLLM KV events.

Everything the server needs is checked before the model loads: the pool, the model folder, the
media folder, the KV-event options and that the port is free.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from minirad.entrypoints.argtypes import non_negative_float, port, positive_int
from minirad.entrypoints.commands.inputs import check_model_dir
from minirad.entrypoints.commands.loading import load_engine
from minirad.entrypoints.commands.options import (
    DefaultsHelpFormatter,
    add_device_options,
    add_engine_options,
    add_threads_option,
    check_pool,
    engine_settings,
)
from minirad.errors import InvalidArgumentError
from minirad.peers.vllm_server import DEFAULT_MODEL_DIR

__all__ = ["add_parser", "check_port_free", "kv_events_endpoint", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """The ``serve`` subparser, its ``run`` set."""
    s = subparsers.add_parser(
        "serve",
        help="serve the model over HTTP (OpenAI-compatible API, as vllm serve)",
        formatter_class=DefaultsHelpFormatter,
        description="An OpenAI-compatible server (minirad.entrypoints.openai.api_server): "
        "/v1/chat/completions, /v1/completions, /v1/models, /health, /metrics (vLLM's metric "
        "names), /tokenize, /detokenize, /reset_prefix_cache (vLLM's), /server_info, "
        "/model_info (SGLang's).",
    )
    s.add_argument(
        "--model",
        default=None,
        help=f"local model folder (default: the shipped {DEFAULT_MODEL_DIR.name}, served under "
        "that name)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=port, default=8000, help="port to listen on")
    s.add_argument(
        "--served-model-name",
        default=None,
        help="the model name clients send and /v1/models lists (default: --model as given)",
    )
    s.add_argument(
        "--allowed-local-media-path",
        default=".",
        metavar="DIR",
        help="image file paths must lie in this folder ('.' is the folder the server is "
        "started in; '/' allows any readable path)",
    )
    add_threads_option(s)
    add_device_options(s)
    s.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=5.0,
        metavar="SECONDS",
        help="on SIGTERM / Ctrl-C, how long requests in flight may take to finish; then they "
        "end with a 503 and the server exits",
    )
    add_engine_options(s)
    events = s.add_argument_group(
        "KV events",
        "publish the radix tree's blocks as vLLM KV events over ZMQ (off by default). The "
        "events carry every cached prompt's token ids: a loopback address keeps them on this "
        "machine, while '*' as the host (tcp://*:5557, vLLM's example) listens on every "
        "network interface, for anyone who can reach the port.",
    )
    events.add_argument(
        "--kv-events-endpoint",
        default=None,
        metavar="URL",
        help="PUB socket (vLLM's KVEventsConfig.endpoint): a port alone (5557) or "
        "tcp://127.0.0.1:5557 listens on loopback, tcp://127.0.0.1:* on a free loopback port "
        "(printed at start); another host is connected to, as vLLM does",
    )
    events.add_argument(
        "--kv-events-replay-endpoint",
        default=None,
        metavar="URL",
        help="replay ROUTER socket (vLLM's replay_endpoint), always listened on: a port alone "
        "(5558) or tcp://127.0.0.1:5558 on loopback",
    )
    events.add_argument(
        "--kv-events-block-size",
        type=positive_int,
        default=None,
        help="tokens per published block (default: vLLM's CPU block size, 32)",
    )
    s.set_defaults(run=run)
    return s


def run(args: argparse.Namespace) -> int:
    """Check what the server needs, load the engine, serve until SIGTERM or Ctrl-C; returns 0.

    Raises:
        MiniradError: what a check or the engine refuses (the command prints it as one line).
    """
    check_pool(args)
    # vLLM serves a model under its --model string; the shipped one under its folder name
    # (its default path is absolute, different on every machine).
    name = args.served_model_name or args.model or DEFAULT_MODEL_DIR.name
    # /server_info and /v1/models show the model path as the user gave it, and the shipped
    # model's by its name: never the server's own folders.
    shown_path = args.model or DEFAULT_MODEL_DIR.name
    args.model = args.model or str(DEFAULT_MODEL_DIR)
    check_model_dir(args.model)
    if not Path(args.allowed_local_media_path).is_dir():
        raise InvalidArgumentError(
            f"--allowed-local-media-path {args.allowed_local_media_path!r} is not a folder"
        )
    events = {
        "kv_events_endpoint": kv_events_endpoint(args.kv_events_endpoint),
        "kv_events_replay_endpoint": kv_events_endpoint(args.kv_events_replay_endpoint),
    }
    if args.kv_events_block_size is not None:
        events["kv_events_block_size"] = args.kv_events_block_size
    if args.kv_events_endpoint is None and (
        args.kv_events_replay_endpoint is not None or args.kv_events_block_size is not None
    ):
        raise InvalidArgumentError("the --kv-events-* options need --kv-events-endpoint")
    check_port_free(args.host, args.port)  # before the model loads, not after
    engine = load_engine(args, **engine_settings(args), **events)
    if (publisher := engine.kv_event_publisher) is not None:  # a '*' port is known only now
        replay = f", replay on {publisher.replay_endpoint}" if publisher.replay_endpoint else ""
        print(f"minirad serve: KV events on {publisher.endpoint}{replay}", file=sys.stderr)
    from minirad.entrypoints.openai.api_server import (
        run_server,  # FastAPI and uvicorn: only this command needs them
    )

    run_server(
        engine,
        host=args.host,
        port=args.port,
        served_model_name=name,
        model_path=shown_path,
        allowed_local_media_path=args.allowed_local_media_path,
        shutdown_timeout_s=args.shutdown_timeout,
    )
    return 0


def kv_events_endpoint(value: str | None) -> str | None:
    """A ``--kv-events-*`` endpoint as given, but a bare port means that port on loopback
    (``"5557"``: ``"tcp://127.0.0.1:5557"``)."""
    if value is not None and value.isdigit():
        return f"tcp://127.0.0.1:{value}"
    return value


def check_port_free(host: str, port: int) -> None:
    """Raises InvalidArgumentError if ``host:port`` cannot be listened on (in use, or not an
    address of this machine). uvicorn binds again afterwards, with the same SO_REUSEADDR."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as e:
        raise InvalidArgumentError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
