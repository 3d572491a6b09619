"""Command-line flags with environment-variable twins (flag wins over variable)."""

import argparse
import logging
import os


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def add(parser: argparse.ArgumentParser, flag: str, *, env: str, default=None, type=str, help: str, **kwargs):
    """Adds `flag`, whose default comes from the environment variable `env` when set."""
    raw = os.environ.get(env)
    if raw is not None:
        default = _parse_bool(raw) if type is bool else type(raw)
    if type is bool:
        kwargs.setdefault("action", argparse.BooleanOptionalAction)
    else:
        kwargs["type"] = type
    parser.add_argument(flag, default=default, help=f"{help} (env {env}; default: %(default)s)", **kwargs)


def add_server_flags(parser: argparse.ArgumentParser, prefix: str, default_port: int) -> None:
    """Flags every service has: where to listen, and logging."""
    add(parser, "--host", env=f"{prefix}_HOST", default="127.0.0.1",
        help="address to bind; 0.0.0.0 to serve other machines")
    add(parser, "--port", env=f"{prefix}_PORT", type=int, default=default_port, help="gRPC port")
    add(parser, "--log-level", env=f"{prefix}_LOG_LEVEL", default="INFO", help="logging level")


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s",
    )
