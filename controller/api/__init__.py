"""The gRPC surface: thin servicers, authorisation, request validation, and domain errors mapped to statuses."""
