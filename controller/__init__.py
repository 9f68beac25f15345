"""The Phalanx controller: node registry and liveness, the event log, and the control API."""
