"""The model catalogue: deployments, their profiles, memory sizing and validation (pure domain)."""
