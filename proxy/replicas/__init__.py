"""The replicas: which exist, how each is reached, and how their stacks are watched."""
