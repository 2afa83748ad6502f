"""kvflow's wire layer: message contract v1, RabbitMQ topology, replies, producer client.

It never imports `worker`; the worker imports it.
"""

from broker.client import Client
from broker.errors import BrokerUnavailable, RequestFailed, SubmitFailed
from broker.handle import Handle
from broker.messages import InvalidRequest
from broker.sync_client import SyncClient, SyncHandle

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
