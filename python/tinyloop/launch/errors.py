"""The launcher's one error type."""


class LaunchError(Exception):
    """A choice or a state the launcher refuses; the message says what is wrong and what to do instead."""
