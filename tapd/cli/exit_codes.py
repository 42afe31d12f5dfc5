"""Named exit codes of the `tapd` command (health probes rely on them)."""

from enum import IntEnum


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1  # something went wrong while running
    USAGE = 2  # bad arguments (argparse's own code)
    UNREACHABLE = 3  # no daemon answered at the endpoint
    CONFIG = 4  # bad configuration
    ALREADY_RUNNING = 5  # a daemon already serves that endpoint
    INTERRUPTED = 130  # Ctrl-C
