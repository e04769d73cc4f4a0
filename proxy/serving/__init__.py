"""The request path: a client's request read, pinned, routed, served, recorded and answered."""
