"""Recovery: the job and rank transition tables, the incident detectors, the pure lifecycle and its executor."""
