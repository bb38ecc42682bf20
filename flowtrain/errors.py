"""``FlowtrainError``: the base class of the errors a user can fix (a bad option, input file, bundle or run
directory). Its message is one line that names the input and the fix; the command line prints it and exits
with status 2. Any other exception is a bug and keeps its traceback. The class itself is defined in the bottom
layer (``connectors.errors``) so that the options ``pipelines`` declares raise one too.
"""
from __future__ import annotations

from connectors.errors import FlowtrainError

__all__ = ["BundleError", "DeadLettersError", "FlowtrainError", "DEAD_LETTERS_EXIT"]

#: The exit status of a command whose input was read but could not be used: nothing predicted, or more dead letters
#: than ``--max-dead-letter-fraction`` allows (2 is a bad option or input that stopped the command before it ran).
DEAD_LETTERS_EXIT = 3


class BundleError(FlowtrainError):
    """A model bundle that cannot be used: a missing or modified file, a newer flowtrain, a spec's column
    absent from the input. The message names the file or the column."""


class DeadLettersError(FlowtrainError):
    """The input was read but too little of it could be used: every row a dead letter (nothing predicted), or more
    dead letters than ``--max-dead-letter-fraction`` allows. The command line exits with ``DEAD_LETTERS_EXIT`` (3);
    the outputs already written (the dead letters with their reasons) stay."""

    exit_code = DEAD_LETTERS_EXIT
