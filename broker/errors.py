"""The producer's errors: the broker could not be reached, did not take a request, or the
worker answered with an error."""

from __future__ import annotations


class BrokerUnavailable(ConnectionError):
    """RabbitMQ could not be reached, or the connection was lost (URL redacted)."""


class SubmitFailed(RuntimeError):
    """The broker did not take the request (unroutable, or refused by the queue)."""


class RequestFailed(Exception):
    """The worker answered with an error reply instead of a result."""

    def __init__(self, code: str, message: str, request_id: str | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.request_id = request_id
