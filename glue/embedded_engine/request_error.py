"""The engine's refusal of a request payload, naming the field: raised by the request schema
(glue.embedded_engine.request_schema) and the text layer (glue.embedded_engine.text_io), answered as an HTTP error."""
from __future__ import annotations


class RequestError(ValueError):
    """A payload the engine refuses; `field` names the offending JSON field (dotted for nested ones). The message
    is prefixed with the field unless it already starts with it. `status` is the HTTP status of the refusal."""

    def __init__(self, field: str, message: str, *, status: int = 400):
        super().__init__(message if message.startswith(field) else f"{field}: {message}")
        self.field, self.status = field, status
