"""``opd serve``'s command line: its options (what one client may cost the server among them) and
the call that starts it. Kept beside the server, so a new limit is one option and one field."""

from __future__ import annotations

import argparse

from opd.checks import positive_arg


def add_serve_command(commands) -> None:
    """The ``serve`` subcommand on ``commands`` (an argparse subparsers object)."""
    serve = commands.add_parser(
        "serve", help="serve a teacher's prompt log-probs (vLLM / SGLang API subset)"
    )
    serve.add_argument("model", help="hub id or local directory of the teacher")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to bind (default loopback only)"
    )
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument(
        "--served-model-name", help="name clients send as 'model' (default: MODEL as given)"
    )
    serve.add_argument(
        "--max-logprobs", type=int, default=20, help="largest top-k a request may ask for"
    )
    serve.add_argument(
        "--max-tokens-per-request",
        type=positive_arg(int),
        default=16384,
        help="most tokens one request may have sampled, prompts x max_tokens (16384)",
    )
    serve.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    serve.add_argument("--device", default="auto")
    serve.add_argument(
        "--max-request-bytes",
        type=positive_arg(int),
        default=16 * 2**20,
        help="larger bodies get 413 (16 MiB)",
    )
    serve.add_argument(
        "--request-timeout",
        type=positive_arg(float),
        default=60.0,
        help="seconds a client may take to send a request before it is dropped (60)",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_arg(int),
        default=64,
        help="connections served at once; more wait their turn (64)",
    )
    serve.add_argument(
        "--max-waiting",
        type=positive_arg(int),
        default=256,
        help="requests held for the model at once, served or waiting; more get 503 with a "
        "Retry-After (256)",
    )
    serve.set_defaults(handler=run_serve)


def run_serve(args: argparse.Namespace) -> None:
    from opd.serve.http import ServerLimits, serve

    serve(
        args.model,
        args.host,
        args.port,
        name=args.served_model_name,
        max_logprobs=args.max_logprobs,
        max_tokens_per_request=args.max_tokens_per_request,
        dtype=args.dtype,
        device=args.device,
        limits=ServerLimits(
            args.max_request_bytes, args.request_timeout, args.max_connections, args.max_waiting
        ),
    )
