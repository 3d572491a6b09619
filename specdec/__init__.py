"""Code the specdec services share: generated protos, model loading, sampling,
session caches and the gRPC server scaffolding. No service logic lives here."""
