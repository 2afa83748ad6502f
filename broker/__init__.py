"""kvflow's wire layer: message contract v1, RabbitMQ topology, replies, producer client.

It never imports `worker`; the worker imports it.
"""

from broker.client import (
    BrokerUnavailable,
    Client,
    Handle,
    RequestFailed,
    SubmitFailed,
    SyncClient,
    SyncHandle,
)
from broker.messages import InvalidRequest

__all__ = [
    "BrokerUnavailable",
    "Client",
    "Handle",
    "InvalidRequest",
    "RequestFailed",
    "SubmitFailed",
    "SyncClient",
    "SyncHandle",
]
