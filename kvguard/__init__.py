"""The ``kvguard`` command: one console script, one subcommand per tool."""
