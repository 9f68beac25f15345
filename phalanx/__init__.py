"""Phalanx: keeps multi-node GPU training alive on bare metal.

This package holds what the agent, the controller and the CLI share: the generated wire protocol
(`phalanx.v1`), the clock, configuration loading, logging and gRPC settings.
"""

__version__ = "0.1.0"
