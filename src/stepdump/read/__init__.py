"""Reading runs: ``Run``, state dicts and restore."""
