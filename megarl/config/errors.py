"""The one error type of the config layer."""

from megarl.errors import UserInputError


class ConfigError(UserInputError):
    """A config the user must fix. ``str(err)`` is one problem per line, each starting with the
    dotted key path it is about (e.g. ``data.train_batch_size: expected int, got str 'abc'``).
    ``err.problems`` holds the same lines as a list; ``err.resolved`` the config as far as it
    resolved (a ``megarl.config.provenance.Resolved``), where the loader got that far."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        self.resolved = None
        super().__init__("\n".join(self.problems))
