"""The node-agent's supervision of replica processes: launch plans, the process handle, the
manager and its control client, CPU cores and priority (see README.md)."""
