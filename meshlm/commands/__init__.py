"""One module per `meshlm` subcommand, each with `add_arguments(parser)` and `run(args) -> int`
(meshlm/cli.py imports the one it runs)."""
