"""inferplane's web console (issue 21): API keys, usage, deployments, playground and alerts,
served under `/console/` behind the edge; see services/console/README.md."""
