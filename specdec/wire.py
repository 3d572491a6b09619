"""Bounds on the size of the services' messages, stated rather than left to gRPC's
default; a module of its own, so that the orchestrator reads them without the model
runtime."""

# What a client's call to the orchestrator, and its answer, may hold: a Generate of a full
# 8k-token history is ~40 KB; a prompt's text may be long.
MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# What the services send each other: a feature drafter's window of the target's features
# rides in one message (a Verify's answer, a resync's Propose): 256 positions x 3 layers x
# 4,096 values x 2 bytes is 6 MiB for a Llama-3.1-8B head. A drafter refuses at start a
# window whose message would not fit.
SERVICE_MESSAGE_BYTES = 64 * 1024 * 1024
# Room in such a message beside its features (tokens, drafts, their distributions).
MESSAGE_SLACK_BYTES = 1024 * 1024


def message_options(limit: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]
