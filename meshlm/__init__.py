"""meshlm: the CLI (cli.py, commands/), the Python client (client/) and the local-mesh demo
(demo/). Imports the pieces; no piece imports it."""
