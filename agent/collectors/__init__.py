"""What the agent observes: GPUs (behind one backend interface) and the host."""
