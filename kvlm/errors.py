"""User-facing error types.

Every error a user can cause (a bad model file, an unknown alias, a prompt that does not fit, an invalid
sampling value) is one of these, carries a one-line message, and is turned by the CLI into that line on
stderr and an exit code, never a traceback. Internal bugs stay ordinary exceptions.
"""


class KvlmError(Exception):
    """Base class of errors caused by the user's input; `exit_code` is what the CLI exits with."""

    exit_code: int = 1


class ModelLoadError(KvlmError):
    """A model file or folder is missing, truncated, corrupt or of an unsupported kind."""


class UnsupportedModelError(ModelLoadError):
    """The file is readable but names an architecture, tensor type or option kvlm does not implement."""


class PromptTooLongError(KvlmError, ValueError):
    """The prompt (plus the requested output) does not fit the model's context or the KV pool."""

    exit_code = 2


class TokenizerError(KvlmError, ValueError):
    """Bad or unsupported tokenizer data, or a chat template that failed; one readable line."""


class ParameterError(KvlmError, ValueError):
    """An invalid value for one named parameter (a sampling option, an engine setting, a request field).

    `param` is the field's name as the caller spelled it in the API (`top_p`, `max_tokens`, ...), so
    the CLI can name the flag and the server can fill OpenAI's `error.param`.
    """

    exit_code = 2

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class SnapshotError(KvlmError):
    """A KV snapshot that cannot be used here: another model, dtype, block size or layout, a corrupt or
    truncated file, or an engine without prefix caching. The engine is left unchanged."""


class LoRAError(ModelLoadError):
    """A LoRA adapter that cannot serve this base: a missing file, a rank or target module that does not
    fit the base model, a name already in use, or an adapter name no request can find."""


class UnknownLoRAError(LoRAError, ParameterError):
    """A request named an adapter that is not loaded (the server answers 404, as for an unknown model)."""

    exit_code = 2

    def __init__(self, name: str) -> None:
        ParameterError.__init__(self, "lora", f"no LoRA adapter named {name!r} is loaded")
        self.name = name
