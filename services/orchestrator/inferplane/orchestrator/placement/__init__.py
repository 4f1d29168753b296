"""Placement of replicas on nodes: values, the policy interface, policies and explanations."""
