"""Envoy's control plane: translation (edge.py) → snapshot cache (cache.py) → ADS server
(server.py), after go-control-plane's split."""
