"""The node-agent's control side: NodeAgentService, node status, orchestrator registration,
and the wiring (`build_node_agent`) the composition root calls."""
