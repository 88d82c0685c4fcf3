"""The one error type of the config layer."""

from megarl.errors import UserInputError


class ConfigError(UserInputError):
    """A config the user must fix. ``str(err)`` is one problem per line, each starting with the
    dotted key path it is about (e.g. ``data.train_batch_size: expected int, got str 'abc'``).
    ``err.problems`` holds the same lines as a list."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))
