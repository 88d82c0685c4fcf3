"""The base of every error that means "fix your input", not "megarl has a bug".

Config typos, malformed dataset rows, checkpoints that do not fit the model, data that cannot
feed the configured algorithm: each raises a subclass of ``UserInputError`` whose message names
the field and the fix. ``launch/train.py`` prints such errors as one clean message (exit status
2) instead of a traceback; anything else is a bug and keeps its traceback.
"""


class UserInputError(ValueError):
    """Bad input the user must fix; ``str(err)`` says what and how."""
