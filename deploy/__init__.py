"""Launchers of specdec deployments (Ray); the Kubernetes manifests live beside them."""
