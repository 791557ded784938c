"""Typed errors raised by Tandem's public API.

Every error a caller can provoke with bad input is an `InvalidRequestError` (also a `ValueError`),
which names the offending field; the server maps it to HTTP 400. Load-time failures are
`ModelLoadError`. Neither leaves the engine in a broken state.
"""


class TandemError(Exception):
    """Base class of all errors Tandem raises on purpose."""


class InvalidRequestError(TandemError, ValueError):
    """A request (prompt or sampling parameters) that cannot be served as given."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


class ModelLoadError(TandemError):
    """A model path, file or configuration that cannot be loaded."""


class UnsupportedQuantizationError(ModelLoadError):
    """A checkpoint quantized by a method Tandem cannot run (`method`: its quant_method, e.g. "fp8",
    "gptq", "awq", "bitsandbytes", "compressed-tensors")."""

    def __init__(self, message: str, method: str) -> None:
        super().__init__(message)
        self.method = method


class ConfigError(TandemError, ValueError):
    """An engine configuration that is invalid (caught at start-up)."""
