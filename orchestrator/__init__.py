"""The orchestrator: the public Generate endpoint and the speculative rounds."""
