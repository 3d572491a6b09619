"""What every benchmark shares: the flags that name the models, the prompt files, the
deployments they start on loopback, one `Generate` call as a client times it, llama.cpp's
server as the yardstick, and the report files.

The benchmarks are a harness over all three services, so they import their modules; the
services themselves still meet only through the protos."""

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from deploy import launch
from specdec import flags, model_files
from specdec.runtime import modeling
from specdec.api.orchestrator.v1 import orchestrator_pb2 as pb, orchestrator_pb2_grpc

DATA = Path(__file__).parent
PROMPTS = DATA / "prompts.txt"  # categories: chat, code, copying tasks, plain text
UNSEEN_PROMPTS = DATA / "unseen_prompts.txt"  # 800 chat questions, none in any training set of ours
STRUCTURED_PROMPTS = DATA / "structured_prompts.jsonl"


def model_flags(parser: argparse.ArgumentParser, out: str, quantize: bool = True, draft: bool = True,
                verbose: bool = True) -> argparse.ArgumentParser:
    """The flags every benchmark that starts a deployment takes, as `specdec up` names them
    (`quantize` False: the benchmark takes its own --quantize, or none)."""
    parser.add_argument("--target", default=modeling.DEFAULT_TARGET)
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32", choices=sorted(modeling.DTYPES))
    if draft:
        parser.add_argument("--draft", default=modeling.DEFAULT_DRAFT)
        parser.add_argument("--drafter-device", default=None, help="the drafters' device (default: --device's)")
        parser.add_argument("--drafter-dtype", default=None, choices=sorted(modeling.DTYPES),
                            help="the draft's dtype (default: float32 on a CPU, else --dtype's)")
    if quantize:
        parser.add_argument("--quantize", default="auto", choices=flags.QUANTIZE,
                            help="numerics of every model (auto: as specdec up)")
    if verbose:
        parser.add_argument("--verbose", action="store_true", help="the services' logs on this terminal")
    parser.add_argument("--out", type=Path, default=Path(out))
    return parser


def parser_for(name: str, doc: str) -> argparse.ArgumentParser:
    return argparse.ArgumentParser(prog=f"specdec bench {name}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


# --- prompts -----------------------------------------------------------------------------


@dataclass
class Prompt:
    category: str
    text: str
    raw: bool = False  # sent as plain text, not through the chat template

    def encode(self, tokenizer) -> list[int]:
        if self.raw:
            return tokenizer(self.text)["input_ids"]
        return chat_ids(tokenizer, self.text)


def chat_ids(tokenizer, text: str) -> list[int]:
    """One user message through the chat template, as the orchestrator renders it; the text
    as it is for a model without one (a base model, which the orchestrator sends text alone)."""
    if not tokenizer.chat_template:
        warnings.warn("the model has no chat template: its chat prompts are sent as plain text")  # once
        return tokenizer(text)["input_ids"]
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False)


def read_prompts(path: Path) -> list[Prompt]:
    """One prompt a line ("\\n" in it is a newline); a line "[name]" starts a category,
    "[name raw]" one of plain-text prompts; "#" starts a comment line."""
    prompts, category, raw = [], "prompts", False
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("[") and line.endswith("]"):
            category, *options = line[1:-1].split()
            raw = "raw" in options
            continue
        prompts.append(Prompt(category, line.replace("\\n", "\n"), raw))
    if not prompts:
        raise SystemExit(f"--prompts: no prompts in {path}")
    return prompts


def spread(items: list, n: int | None) -> list:
    """n of items, evenly spaced; all of them for None."""
    if n is None or n >= len(items):
        return items
    return [items[i * len(items) // n] for i in range(n)]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def ratio(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}x"


# --- deployments -------------------------------------------------------------------------


def plan(args, drafters: int = 1, draft: str | None = None, overlap: bool = False, verifier_flags=(),
         drafter_flags=(), orchestrator_flags=(), quantize: str | None = None) -> list[launch.Service]:
    """One deployment as `specdec up` starts it, with the run's models and numerics
    (`quantize`, else the run's --quantize)."""
    quantize = quantize or getattr(args, "quantize", None)
    numerics = ["--quantize", quantize] if quantize else []
    services = launch.plan(args.target, draft or args.draft, drafters, launch.free_port(), args.dtype, args.device,
                           overlap, verifier_flags=[*numerics, *verifier_flags],
                           drafter_flags=[*numerics, *drafter_flags],
                           drafter_device=getattr(args, "drafter_device", None),
                           drafter_dtype=getattr(args, "drafter_dtype", None))
    services[-1].argv += list(orchestrator_flags)
    return services


@contextlib.contextmanager
def running(*deployments: list[launch.Service], log_dir: Path | None = None, timeout_s: float = 900):
    """Starts the deployments together (their models load at once), waits until all
    serve, and stops them on the way out. log_dir: their output goes to services.log
    there (None: this terminal)."""
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / "services.log", "a") if log_dir is not None else None
    try:
        try:  # a deployment that fails to start stops those started before it
            for services in deployments:
                launch.start(services, log=log)
            for services in deployments:
                launch.wait_serving(services, timeout_s)
            yield deployments
        finally:
            for services in deployments:
                launch.stop(services)
    finally:
        if log is not None:
            log.close()


def log_dir(args) -> Path | None:
    return None if getattr(args, "verbose", True) else args.out


@contextlib.contextmanager
def orchestrator(services: list[launch.Service]):
    """A stub of the deployment's orchestrator."""
    with grpc.insecure_channel(services[-1].address) as channel:
        yield orchestrator_pb2_grpc.OrchestratorServiceStub(channel)


# --- one call ----------------------------------------------------------------------------


@dataclass
class Stream:
    """One `Generate` call as its client saw it."""
    tokens: list[int] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # per token: seconds after `started`
    started: float = 0.0  # seconds after the clock the caller gave (0 for a call timed alone)
    seconds: float = 0.0  # the whole call
    first_chunk: int = 0  # tokens in the first chunk
    result: pb.Result | None = None

    @property
    def stats(self) -> pb.SpeculationStats:
        return self.result.stats if self.result is not None else pb.SpeculationStats()

    def after_first(self) -> tuple[int, float]:
        """(tokens, seconds) after the first chunk: the decoding, without the prompt's prefill."""
        if not self.arrivals:
            return 0, 0.0
        return len(self.tokens) - self.first_chunk, self.started + self.seconds - self.arrivals[0]

    def rate_after_first(self) -> float:
        """Tokens per second after the first chunk (the whole call's rate for a one-chunk output)."""
        n, s = self.after_first()
        return n / s if n else len(self.tokens) / self.seconds

    def _chunk(self, ids, now: float) -> None:
        if not self.tokens:
            self.first_chunk = len(ids)
        self.tokens += ids
        self.arrivals += [now] * len(ids)


def request(ids: list[int] | None = None, text: str | None = None, chat: str | None = None,
            max_new_tokens: int = 64, k: int | None = None, **fields) -> pb.GenerateRequest:
    """A greedy request from token ids, plain text or one user message; k None: the
    deployment's choice of K; `fields`: more of GenerateRequest's (penalties, ...)."""
    r = pb.GenerateRequest(max_new_tokens=max_new_tokens, **fields)
    if ids is not None:
        r.token_ids.ids.extend(ids)
    elif text is not None:
        r.text = text
    else:
        r.chat.messages.append(pb.ChatMessage(role="user", content=chat))
    if k is not None:
        r.num_speculative_tokens = k
    return r


def stream(stub, req: pb.GenerateRequest, timeout: float = 1200, first_only: bool = False) -> Stream:
    """The call, timed; first_only: cancelled at its first token (a time to first token)."""
    out, started = Stream(), time.perf_counter()
    call = stub.Generate(req, timeout=timeout)
    for message in call:
        if message.HasField("chunk"):
            out._chunk(list(message.chunk.token_ids), time.perf_counter() - started)
            if first_only and out.tokens:
                call.cancel()
                break
        else:
            out.result = message.result
    out.seconds = time.perf_counter() - started
    return out


async def stream_async(stub, req: pb.GenerateRequest, out: Stream, t0: float, timeout: float = 3600) -> None:
    """The call on an asyncio stub, into `out` (times after t0, so that the calls of one
    run share a clock); a failed call sets no result and raises grpc.aio.AioRpcError."""
    out.started = time.perf_counter() - t0
    try:
        async for message in stub.Generate(req, timeout=timeout):
            if message.HasField("chunk"):
                out._chunk(list(message.chunk.token_ids), time.perf_counter() - t0)
            else:
                out.result = message.result
    finally:
        out.seconds = time.perf_counter() - t0 - out.started


# --- llama.cpp ---------------------------------------------------------------------------


def penalties_processor(prompt_length: int, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                        repetition_penalty: float = 1.0, logit_bias: dict | None = None):
    """The target alone's penalties for transformers' `generate`, by their definitions
    (a LogitsProcessor): the bias, transformers' own repetition penalty over prompt and
    output, OpenAI's frequency and presence penalties over the output."""
    from transformers import LogitsProcessor, RepetitionPenaltyLogitsProcessor

    class Penalised(LogitsProcessor):
        def __init__(self):
            self.repetition = RepetitionPenaltyLogitsProcessor(repetition_penalty)

        def __call__(self, input_ids, scores):
            scores = scores.clone()
            for token, value in (logit_bias or {}).items():
                scores[:, token] += value
            scores = self.repetition(input_ids, scores)
            output = input_ids[0, prompt_length:].tolist()
            for token in set(output):
                scores[:, token] -= frequency_penalty * output.count(token) + presence_penalty
            return scores

    return Penalised()


def constraint_processor(guide):
    """The target alone under a constraint for transformers' `generate` (a LogitsProcessor):
    the grammar's whole mask applied at each step, as the target alone is defined, not
    the verifier's shortcuts. `guide`: a specdec.grammar.Guide from the prompt's end."""
    from transformers import LogitsProcessor

    from specdec import grammar

    class Masked(LogitsProcessor):
        def __call__(self, input_ids, scores):
            if not guide.sync(input_ids[0].tolist()):
                raise RuntimeError("the reference's output left its grammar")
            return grammar.apply(scores, guide.mask()[None].to(scores.device))

    return Masked()


def gguf_of(target: str) -> str:
    gguf = model_files.gguf_file(target)
    if gguf is None:
        raise SystemExit("--llama-cpp needs a GGUF target")
    return gguf


@contextlib.contextmanager
def llama_server(bin_dir: str, target: str, slots: int = 1, threads: int | None = None, extra=()):
    """llama.cpp's `llama-server` on the target's GGUF file, on loopback (every core unless
    `threads`; `extra`: more of its flags): yields its URL."""
    port = launch.free_port()
    process = subprocess.Popen([f"{bin_dir}/llama-server", "-m", gguf_of(target), "--host", launch.HOST,
                                "--port", str(port), "-t", str(threads or os.cpu_count()), "-np", str(slots),
                                "-c", str(slots * 2048), *extra], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    url, deadline = f"http://{launch.HOST}:{port}", time.monotonic() + 300
    try:
        while True:
            try:
                urllib.request.urlopen(f"{url}/health", timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline or process.poll() is not None:
                    raise RuntimeError(f"llama-server did not start ({bin_dir})")
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def llama_completion(url: str, ids: list[int], max_new_tokens: int, **options) -> dict:
    """One greedy /completion of the token ids, not streamed, the prompt not cached."""
    body = {"prompt": ids, "n_predict": max_new_tokens, "temperature": 0, "top_k": 1, "cache_prompt": False,
            **options}
    req = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as response:
        return json.loads(response.read())


# --- reports -----------------------------------------------------------------------------


def write_report(out: Path, name: str, report: dict, markdown: str, echo: bool = True) -> None:
    """name.json (the report, the command line in it) and name.md under out; echo: the
    Markdown on this terminal too (a benchmark that printed its lines as it went: not)."""
    out.mkdir(parents=True, exist_ok=True)
    report.setdefault("meta", {})["command"] = " ".join(sys.argv)
    (out / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
    (out / f"{name}.md").write_text(markdown)
    if echo:
        print(markdown, flush=True)


def failed_if(condition: bool, message: str) -> int:
    """A benchmark's exit status: 1, with the reason on stderr, when an output check failed."""
    if condition:
        print(message, file=sys.stderr)
        return 1
    return 0
