"""Entry points around a run: info, memory estimate, evaluation, export, serving, GKE manifests."""
