"""``FlowtrainError``: the base class of the errors a user can fix (a bad option, input file, bundle or run
directory). Its message is one line that names the input and the fix; the command line prints it and exits
with status 2. Any other exception is a bug and keeps its traceback.

It lives in the bottom layer so that every layer's user errors can be one (``connectors.fields.OptionError``:
the options declared in ``pipelines`` and ``flowtrain`` alike); ``flowtrain.errors`` holds flowtrain's own.
"""
from __future__ import annotations


class FlowtrainError(ValueError):
    """A user error: the message names the input and what to do. (A ``ValueError`` too, so code that caught
    the errors flowtrain raised before keeps working.)"""
