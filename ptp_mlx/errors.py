"""The one error type every layer raises for bad usage or bad input (docs/conventions.md, "Streams and exit codes").

It lives apart from ``cli_common`` so that library modules (models, layers, adapters, converters) can raise it
without importing the command-line helpers, which import them in turn.
"""


class UserError(Exception):
    """Bad usage or bad input: reported as one ``error:`` line with exit code 2."""
