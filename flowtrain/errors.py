"""``FlowtrainError``: the base class of the errors a user can fix (a bad option, input file, bundle or run
directory). Its message is one line that names the input and the fix; the command line prints it and exits
with status 2. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class FlowtrainError(ValueError):
    """A user error: the message names the input and what to do. (A ``ValueError`` too, so code that caught
    the errors flowtrain raised before keeps working.)"""


class BundleError(FlowtrainError):
    """A model bundle that cannot be used: a missing or modified file, a newer flowtrain, a spec's column
    absent from the input. The message names the file or the column."""
