"""The `phalanx` command line."""
