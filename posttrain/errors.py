"""The one exception type for errors a user can cause and fix: a bad value, a missing file, a folder in use.

The CLI prints a ``UserError`` as one line and exits with status 2, wherever in the run it is raised; every
other exception is a bug and keeps its traceback. It subclasses ``ValueError`` so that code and tests that
catch a bad value keep catching it.
"""


class UserError(ValueError):
    """An error the user caused and can fix; the message names the setting or path and what to do."""
