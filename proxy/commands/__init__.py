"""The `stackpin` command line, and what only it uses."""
