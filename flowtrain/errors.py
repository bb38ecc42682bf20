"""``FlowtrainError``: the base class of the errors a user can fix (a bad option, input file, bundle or run
directory). Its message is one line that names the input and the fix; the command line prints it and exits
with status 2. Any other exception is a bug and keeps its traceback. The class itself is defined in the bottom
layer (``connectors.errors``) so that the options ``pipelines`` declares raise one too.
"""
from __future__ import annotations

from connectors.errors import FlowtrainError

__all__ = ["BundleError", "FlowtrainError"]


class BundleError(FlowtrainError):
    """A model bundle that cannot be used: a missing or modified file, a newer flowtrain, a spec's column
    absent from the input. The message names the file or the column."""
