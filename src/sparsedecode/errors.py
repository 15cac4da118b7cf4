"""The one exception type that means "the user's input is wrong".

The CLI turns it into a single line on stderr and exit code 2; anything else
is a bug and keeps its traceback.
"""


class InputError(ValueError):
    """Bad input: the message says what is wrong and how to fix it."""
