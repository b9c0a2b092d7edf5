"""Kubernetes side of the agent."""
