"""Command-line flags with environment-variable twins (flag wins over variable)."""

import argparse
import os
import re


# How a model computes on a CPU (specdec.runtime.quantize; a flag of the services and of `specdec up`).
QUANTIZE = ("auto", "gguf", "q8_m", "q8_0", "q4_0", "int8", "none")
QUANTIZE_HELP = ("CPU numerics, exact against the target alone with the same numerics. gguf: a .gguf model's own "
                 "4- or 8-bit blocks; q8_m (8-bit with a scale and a minimum per block), q8_0, q4_0 (GGUF's types): "
                 "any other model's weights quantized at load into those blocks, the same kernels (a Llama, "
                 "Mistral, Qwen2 or Qwen3 model's layers in one kernel call); both with activations in 16-bit "
                 "integers per block of 32. int8: int8 weights and per-row int8 activations in every linear layer. "
                 "auto: on a CPU, gguf for a .gguf model whose blocks we multiply, q8_m for other models whose "
                 "layers take whole blocks of 32, int8 otherwise; none elsewhere")


def _parse_bool(text: str) -> bool:
    return text.strip().lower() in ("1", "true", "yes", "on")


def add(parser: argparse.ArgumentParser, flag: str, *aliases: str, env: str, default=None, type=str, help: str,
        **kwargs):
    """Adds `flag` (and its `aliases`), whose default comes from the environment variable
    `env` when set."""
    raw = os.environ.get(env)
    if raw is not None:
        default = _parse_bool(raw) if type is bool else type(raw)
    if type is bool:
        kwargs.setdefault("action", argparse.BooleanOptionalAction)
    else:
        kwargs["type"] = type
    action = parser.add_argument(flag, *aliases, default=default, help=f"{help} (env {env}; default: %(default)s)", **kwargs)
    action.env = env


_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3}


def byte_size(text: str) -> int:
    """A byte count: 1073741824, 1GiB, 512Mi, 2G, ..."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmg]i?)?b?\s*", text.lower())
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 1073741824, 1GiB, 512MiB)")
    return int(float(match.group(1)) * _UNITS[match.group(2) or ""])


def env_names(parser: argparse.ArgumentParser) -> set[str]:
    """The environment variables a parser reads."""
    return {a.env for a in parser._actions if hasattr(a, "env")}


def add_session_service_flags(parser: argparse.ArgumentParser, prefix: str) -> None:
    """Flags of the services that load a model and keep sessions (drafter, verifier)."""
    add(parser, "--dtype", env=f"{prefix}_DTYPE", default="float32", choices=["float32", "float16", "bfloat16"],
        help="weights dtype")
    add(parser, "--quantize", env=f"{prefix}_QUANTIZE", default="auto", choices=QUANTIZE, help=QUANTIZE_HELP)
    add(parser, "--threads", env=f"{prefix}_THREADS", type=int, default=0,
        help="CPU threads of a forward pass (0: one per core). Services that share cores run faster with "
             "fewer: a pass's threads wait at every operation for the slowest, and a core lent elsewhere stalls it")
    add(parser, "--device", env=f"{prefix}_DEVICE", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
    add(parser, "--max-sessions", env=f"{prefix}_MAX_SESSIONS", type=int, default=256,
        help="open sessions before RESOURCE_EXHAUSTED")
    add(parser, "--session-idle-timeout", env=f"{prefix}_SESSION_IDLE_TIMEOUT", type=float, default=300.0,
        help="seconds before an idle session is released")
    add(parser, "--kv-cache-bytes", env=f"{prefix}_KV_CACHE_BYTES", type=byte_size, default="1GiB",
        help="memory of the KV pool all sessions share; a session is admitted when its tokens fit")
    add(parser, "--max-waiting-sessions", env=f"{prefix}_MAX_WAITING_SESSIONS", type=int, default=64,
        help="sessions that may wait for KV memory before RESOURCE_EXHAUSTED")
    add(parser, "--max-batch-rows", env=f"{prefix}_MAX_BATCH_ROWS", type=int, default=64,
        help="sessions one forward pass may run together (1: no batching)")
    add(parser, "--max-batch-tokens", env=f"{prefix}_MAX_BATCH_TOKENS", type=int, default=256,
        help="tokens one forward pass computes; a longer prefill runs in chunks between other sessions' rounds")
    add(parser, "--cuda-graphs", env=f"{prefix}_CUDA_GRAPHS", default="off", choices=["off", "on", "compiled"],
        help="Llama-family models on a GPU: passes of up to 64 tokens in static shapes, replayed from CUDA graphs "
             "(on: the eager operations, every bucket captured at start-up; compiled: torch.compile's fused "
             "kernels, each bucket compiled and captured at its first use, about 40 s). The host launches one "
             "graph, not each operation. Ignored for a model on a CPU")
    add(parser, "--batch-invariant", env=f"{prefix}_BATCH_INVARIANT", type=int, default=0,
        help="N > 0: every forward pass runs as passes of exactly N tokens (padded, a longer one in turn), so "
             "a token's logits are the same bits in a one-token step, a verify pass or a batch of sessions: "
             "greedy speculation in bfloat16/float16 then gives the target alone's tokens. Llama-family models; "
             "replayed from CUDA graphs with --cuda-graphs. 0: off (a pass's shape follows its tokens)")
    add(parser, "--prefix-caching", env=f"{prefix}_PREFIX_CACHING", type=bool, default=True,
        help="a session whose prompt starts with blocks another session computed (a system prompt, a chat's "
             "earlier turns) takes their keys and values instead of computing them again")


def setup_logging(level: str, service: str, fmt: str = "text") -> None:
    from specdec import logs

    logs.setup(level, service, fmt)
