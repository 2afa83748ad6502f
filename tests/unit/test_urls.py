"""URLs of the services: passwords masked in every spelling, the management API's address
(no services)."""

from __future__ import annotations

import pytest

from broker.redact import redact_text, redact_url
from worker.admin.queues import ManagementApi, vhost_of


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("amqp://guest:guest@localhost:5672/", "amqp://guest:***@localhost:5672/"),
        ("amqps://u:p%40ss@[::1]:5671/vh", "amqps://u:***@[::1]:5671/vh"),
        (
            "postgresql://u:pw@h:5/db?options=-csearch_path%3Dx",
            "postgresql://u:***@h:5/db?options=-csearch_path%3Dx",
        ),
        ("postgresql+asyncpg://u@h/db", "postgresql+asyncpg://u@h/db"),
        ("sqlite:///var/kvflow/ledger.db", "sqlite:///var/kvflow/ledger.db"),
        ("amqp://u:pw@h:99999/", "amqp://u:***@h:99999/"),  # a bad port: masked all the same
        ("not a url://u:pw@h", "not a url://u:***@h"),
    ],
)
def test_redact_url_masks_every_kind_of_url(url: str, shown: str) -> None:
    assert redact_url(url) == shown


def test_redact_text_masks_the_url_and_its_password_in_any_spelling() -> None:
    url = "postgresql://u:p%40ss@h/db"
    text = f"connect to {url} failed: password p@ss (p%40ss) rejected"
    assert redact_text(text, url) == (
        "connect to postgresql://u:***@h/db failed: password *** (***) rejected"
    )
    assert redact_text("nothing secret", "amqp://h/") == "nothing secret"


def test_management_api_follows_the_broker_url() -> None:
    plain = ManagementApi.for_broker("amqp://kv:s%2Fcret@rabbit.example:5672/prod")
    assert plain.base_url == "http://rabbit.example:15672"
    assert (plain.user, plain.password) == ("kv", "s/cret")
    tls = ManagementApi.for_broker("amqps://kv:pw@rabbit.example/prod")
    assert tls.base_url == "https://rabbit.example:15671"
    assert tls.queue_url("prod", "kvflow.requests") == (
        "https://rabbit.example:15671/api/queues/prod/kvflow.requests"
    )
    given = ManagementApi.for_broker("amqps://[::1]/", "https://mgmt:8443/")
    assert given.base_url == "https://mgmt:8443" and given.user == "guest"
    assert ManagementApi.for_broker("amqps://[::1]/").base_url == "https://[::1]:15671"
    assert ManagementApi.for_broker("amqp://h/").queue_url("/", "q") == (
        "http://h:15672/api/queues/%2F/q"
    )
    with pytest.raises(ValueError, match="not an AMQP URL"):
        ManagementApi.for_broker("http://h/")
    assert (vhost_of("amqp://h/"), vhost_of("amqp://h"), vhost_of("amqp://h/a%2Fb")) == (
        "/",
        "/",
        "a/b",
    )
