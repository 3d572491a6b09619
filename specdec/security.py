"""Transport security and authentication, from flags with environment twins.

Every service can serve TLS (`--tls-cert`, `--tls-key`) and require client certificates
signed by a CA (`--tls-client-ca`: mutual TLS). The orchestrator, the one service that
calls the others, verifies them against `--tls-ca` and shows its own certificate
(`--tls-client-cert`, `--tls-client-key`). Generate can require a bearer token
(`--auth-token-file`); health and reflection stay open, so probes and tools work. With
none of these flags a service is plaintext, as on loopback (`specdec up`)."""

import argparse
import hmac
import logging
from pathlib import Path

import grpc

from specdec import flags

log = logging.getLogger(__name__)

# Always reachable without a token: probes and tools must be able to ask.
OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")


def add_server_flags(parser: argparse.ArgumentParser, prefix: str) -> None:
    add = flags.add
    add(parser, "--tls-cert", env=f"{prefix}_TLS_CERT", default="",
        help="PEM certificate (chain) this service presents; with --tls-key, it serves TLS only")
    add(parser, "--tls-key", env=f"{prefix}_TLS_KEY", default="", help="PEM private key of --tls-cert")
    add(parser, "--tls-client-ca", env=f"{prefix}_TLS_CLIENT_CA", default="",
        help="PEM CA bundle: callers must present a certificate it signed (mutual TLS)")
    add(parser, "--health-port", env=f"{prefix}_HEALTH_PORT", type=int, default=0,
        help="a second, plaintext port that serves grpc.health.v1 only (for probes that speak no TLS); "
             "0: none")


def add_client_flags(parser: argparse.ArgumentParser, prefix: str) -> None:
    add = flags.add
    add(parser, "--tls-ca", env=f"{prefix}_TLS_CA", default="",
        help="PEM CA bundle the verifier's and drafters' certificates are checked against (TLS to them)")
    add(parser, "--tls-client-cert", env=f"{prefix}_TLS_CLIENT_CERT", default="",
        help="PEM certificate shown to the verifier and drafters (their --tls-client-ca)")
    add(parser, "--tls-client-key", env=f"{prefix}_TLS_CLIENT_KEY", default="", help="PEM key of --tls-client-cert")
    add(parser, "--tls-server-name", env=f"{prefix}_TLS_SERVER_NAME", default="",
        help="the name the verifier's and drafters' certificates are checked for, when it is not the host "
             "dialled (drafter pods are dialled by IP)")


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def server_credentials(args) -> grpc.ServerCredentials | None:
    if not (args.tls_cert or args.tls_key):
        if args.tls_client_ca:
            raise SystemExit("--tls-client-ca needs --tls-cert and --tls-key: mutual TLS is TLS first")
        return None
    if not (args.tls_cert and args.tls_key):
        raise SystemExit("--tls-cert and --tls-key go together")
    client_ca = _read(args.tls_client_ca) if args.tls_client_ca else None
    return grpc.ssl_server_credentials([(_read(args.tls_key), _read(args.tls_cert))], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def channel_credentials(args) -> grpc.ChannelCredentials | None:
    """How the orchestrator reaches the verifier and drafters: None for plaintext."""
    if not (args.tls_ca or args.tls_client_cert or args.tls_client_key):
        return None
    if bool(args.tls_client_cert) != bool(args.tls_client_key):
        raise SystemExit("--tls-client-cert and --tls-client-key go together")
    return grpc.ssl_channel_credentials(
        root_certificates=_read(args.tls_ca) if args.tls_ca else None,
        private_key=_read(args.tls_client_key) if args.tls_client_key else None,
        certificate_chain=_read(args.tls_client_cert) if args.tls_client_cert else None)


def channel_options(args) -> list[tuple[str, str]]:
    return [("grpc.ssl_target_name_override", args.tls_server_name)] if args.tls_server_name else []


def aio_channel(address: str, credentials: grpc.ChannelCredentials | None, options=()) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=list(options))


def load_tokens(path: str) -> list[bytes]:
    """Bearer tokens, one per line (blank lines and # comments skipped)."""
    lines = [line.strip() for line in Path(path).read_text().splitlines()]
    tokens = [line.encode() for line in lines if line and not line.startswith("#")]
    if not tokens:
        raise SystemExit(f"{path}: no token in it")
    return tokens


def bearer_ok(authorization: str, tokens: list[bytes]) -> bool:
    """Whether an `Authorization` value is `Bearer <one of the tokens>`."""
    scheme, _, token = authorization.partition(" ")
    presented = token.strip().encode()
    # Compared with every token in constant time: no early exit tells which one is near.
    matches = [hmac.compare_digest(presented, t) for t in tokens]
    return scheme.lower() == "bearer" and any(matches)


def ssl_context(args):
    """The TLS of an HTTP port, from the service's --tls-* flags (None: plaintext)."""
    import ssl

    if not (args.tls_cert and args.tls_key):
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(args.tls_cert, args.tls_key)
    if args.tls_client_ca:
        context.load_verify_locations(args.tls_client_ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


class BearerAuth(grpc.aio.ServerInterceptor):
    """UNAUTHENTICATED for a call without `authorization: Bearer <one of the tokens>`,
    except to the open services (health, reflection)."""

    def __init__(self, tokens: list[bytes]):
        self.tokens = tokens

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "authorization: a bearer token is required (metadata 'authorization: Bearer ...')")

        self.refusals = {
            (False, False): grpc.unary_unary_rpc_method_handler(refuse),
            (False, True): grpc.unary_stream_rpc_method_handler(refuse),
            (True, False): grpc.stream_unary_rpc_method_handler(refuse),
            (True, True): grpc.stream_stream_rpc_method_handler(refuse),
        }

    def allowed(self, metadata) -> bool:
        for key, value in metadata or ():
            if key == "authorization":
                return bearer_ok(value if isinstance(value, str) else value.decode(), self.tokens)
        return False

    async def intercept_service(self, continuation, details):
        if details.method.startswith(OPEN_SERVICES) or self.allowed(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None
        log.warning("refused %s: no valid bearer token", details.method)
        return self.refusals[(bool(handler.request_streaming), bool(handler.response_streaming))]


def auth_interceptors(path: str) -> list[grpc.aio.ServerInterceptor]:
    return [BearerAuth(load_tokens(path))] if path else []
