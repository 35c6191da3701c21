"""The scenarios of `meshlm demo --scenario NAME`, one module each (meshlm/demo/scenario.py lists
them and says what a scenario module exports)."""
