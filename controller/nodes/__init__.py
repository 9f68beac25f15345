"""Nodes: the registry and its one state machine, liveness from heartbeats, the GPU health policy, agent sessions."""
