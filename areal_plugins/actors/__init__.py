"""Ray actors of our own, each in its own process, reached by name from the driver and the workers alike: the progress
board the stall guard reads, the inbox of settled prompt groups."""
