"""The embedded default model pair, by name (specdec.runtime.modeling resolves the names): a
module of its own, so that a thin client can name them without loading torch."""

DEFAULT_TARGET = "smollm2-135m-instruct"
# Distilled from the default target (tools.distill), shipped in specdec/models.
DEFAULT_DRAFT = "smollm2-135m-draft"
