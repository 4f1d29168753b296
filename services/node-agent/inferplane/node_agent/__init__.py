"""inferplane.node_agent: NodeAgentService and InferenceService for the replicas of one node."""
