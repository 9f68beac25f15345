"""Jobs: the queue and its manager, gang placement, and the network topology placement reads."""
