"""torchrun's rendezvous: the book of rounds (pure); its servicer is in controller.api."""
