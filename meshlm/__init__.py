"""meshlm: the CLI and the local-mesh launcher. Imports the pieces; no piece imports it."""
