"""The `tierlab` command line: one module per command, listed in `main.COMMANDS`."""
