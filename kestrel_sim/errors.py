"""User-facing errors: the CLI prints their message as one paragraph, no traceback."""


class KestrelError(Exception):
    """Bad input a user can fix. The message says what, where, and what is expected."""


class ConfigError(KestrelError):
    """A scenario, hardware, profile or model description that does not validate."""


class OutputError(KestrelError):
    """An output folder that cannot be written, or that holds work not to be overwritten."""
