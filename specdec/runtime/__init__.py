"""The model runtime: the engine (batched passes over paged KV caches), the C++ kernels,
the models and their loading, quantization and GGUF blocks, the EAGLE-3 head. Only the
verifier and the drafter import it; the orchestrator never does."""
