"""How the proxy runs as processes: launch, workers and their supervisor, signals, the listener, and
what a proxy does once at start."""
