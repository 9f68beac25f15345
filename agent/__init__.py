"""The Phalanx node agent: collects host and GPU state and keeps a session with the controller."""
