"""The root of AReno's user-facing errors.

Every error a user can cause derives from `ArenoError`. It carries the HTTP status the server
answers with and the OpenAI error `type` / `code`, so the serving layer maps errors without
knowing each class, and training reports them by name.
"""

from __future__ import annotations


class ArenoError(Exception):
    """A failure caused by user input or configuration, with a message the user can act on."""

    status_code: int = 400
    error_type: str = "invalid_request_error"
    code: str = "invalid_request"

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self):
        # Errors cross process boundaries (Ray actors, Serve replicas): keep every attribute,
        # whatever the subclass's __init__ takes.
        return (_rebuild_error, (type(self), self.message, dict(self.__dict__)))

    def to_dict(self) -> dict:
        """The OpenAI error object for this error."""
        return {
            "message": self.message,
            "type": self.error_type,
            "param": self.param,
            "code": self.code,
        }


def _rebuild_error(cls: type, message: str, state: dict) -> ArenoError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ConfigError(ArenoError):
    """A configuration value is invalid (a flag, a config file field)."""

    code = "invalid_config"


class CacheMemoryError(ConfigError):
    """The engine's cache, sized by --max-running-prompts and --max-context-len, does not fit in
    the memory left on its device."""

    code = "cache_too_large"


class UnsupportedModelError(ArenoError):
    """The checkpoint's family has no adapter."""

    code = "unsupported_model"


class UnsupportedModalityError(ArenoError):
    """The loaded model family does not accept this modality."""

    code = "unsupported_modality"


class PromptTooLongError(ArenoError):
    """The processor-encoded prompt exceeds --max-prompt-tokens or --max-context-len."""

    code = "context_length_exceeded"
