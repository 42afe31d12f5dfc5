"""The `tapd` command line."""
