"""Message contract v1: round trips, every refusal with its message, AMQP property fallbacks.

Pure msgpack, no broker.
"""

from __future__ import annotations

import datetime as dt

import msgpack
import pytest

from broker.messages import (
    DEFAULT_MAX_MESSAGE_BYTES,
    MAX_METADATA_BYTES,
    InvalidRequest,
    RequestMessage,
    decode_reply,
    decode_request,
    encode_delta,
    encode_error,
    encode_request,
    encode_result,
)


def _body(**fields) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def _refused(body: bytes, **props) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        decode_request(body, **props)
    assert info.value.code == "invalid_request"
    return info.value


# -- round trips ----------------------------------------------------------------------------


def test_request_round_trip_keeps_every_field_and_float_types():
    body = encode_request(
        id="r1",
        prompt="Hello",
        sampling={
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 1,
            "top_k": 40,
            "min_p": 0.0,
            "seed": 7,
            "stop": "\n",
            "stop_token_ids": (2, 3),
            "ignore_eos": True,
            "min_tokens": 1,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.0,
            "frequency_penalty": -0.5,
            "logprobs": 2,
        },
        priority=-3,
        deadline=1_700_000_000.25,
        stream=True,
        metadata={"user": "u1", "tags": ["a", 1, 2.5, None, True]},
    )
    msg = decode_request(body, reply_to="replies", content_type="application/msgpack")
    assert msg == RequestMessage(
        id="r1",
        prompt="Hello",
        sampling={
            "max_tokens": 8,
            "temperature": 0.5,
            "top_p": 1.0,
            "top_k": 40,
            "min_p": 0.0,
            "seed": 7,
            "stop": ["\n"],
            "stop_token_ids": [2, 3],
            "ignore_eos": True,
            "min_tokens": 1,
            "repetition_penalty": 1.1,
            "presence_penalty": 0.0,
            "frequency_penalty": -0.5,
            "logprobs": 2,
        },
        priority=-3,
        deadline=1_700_000_000.25,
        stream=True,
        metadata={"user": "u1", "tags": ["a", 1, 2.5, None, True]},
        reply_to="replies",
        correlation_id="r1",
    )
    assert isinstance(msg.sampling["top_p"], float)
    assert isinstance(msg.deadline, float)


def test_messages_and_token_ids_round_trip():
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    msg = decode_request(encode_request(id="c", messages=chat))
    assert msg.messages == chat and msg.prompt is None and msg.sampling == {}
    msg = decode_request(encode_request(id="t", prompt_token_ids=[1, 2, 3]))
    assert msg.prompt_token_ids == [1, 2, 3] and msg.stream is False


def test_sampling_dict_feeds_sampling_params():
    from worker.request import SamplingParams

    msg = decode_request(_body(id="x", prompt="p", stop=["a", "b"], temperature=0, max_tokens=4))
    params = SamplingParams(**msg.sampling)
    assert params.stop == ("a", "b") and params.greedy and params.max_tokens == 4


def test_nil_fields_count_as_absent():
    msg = decode_request(_body(id="x", prompt="p", messages=None, seed=None, metadata=None))
    assert msg.sampling == {} and msg.metadata is None


def test_replies_round_trip():
    delta = decode_reply(encode_delta("r", 0, "He", [10, 11]))
    assert delta == {"id": "r", "type": "delta", "index": 0, "text": "He", "token_ids": [10, 11]}
    timing = {"enqueued_at": 1.5, "queue_s": 0.25, "preemptions": 0}
    result = decode_reply(
        encode_result(
            "r",
            text="Hello",
            token_ids=[10, 11, 12],
            finish_reason="stop",
            prompt_tokens=5,
            completion_tokens=3,
            timing=timing,
            worker="w1",
            metadata={"k": "v"},
            logprobs=[[-0.1]],
        )
    )
    assert result == {
        "id": "r",
        "type": "result",
        "text": "Hello",
        "token_ids": [10, 11, 12],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        "timing": timing,
        "worker": "w1",
        "metadata": {"k": "v"},
        "logprobs": [[-0.1]],
    }
    assert isinstance(result["timing"]["enqueued_at"], float)
    error = decode_reply(encode_error("r", "expired", "deadline passed"))
    assert error == {
        "id": "r",
        "type": "error",
        "error": {"code": "expired", "message": "deadline passed"},
    }


def test_encode_error_refuses_unknown_codes():
    with pytest.raises(ValueError, match="unknown error code 'oops'"):
        encode_error("r", "oops", "x")


def test_decode_reply_refuses_garbage():
    with pytest.raises(ValueError, match="not valid msgpack"):
        decode_reply(b"\xc1")
    with pytest.raises(ValueError, match="must be a msgpack map"):
        decode_reply(msgpack.packb([1]))
    with pytest.raises(ValueError, match="reply type must be one of"):
        decode_reply(msgpack.packb({"id": "x", "type": "other"}))


# -- AMQP property fallbacks -------------------------------------------------------------------


def test_id_falls_back_to_message_id_then_correlation_id():
    body = _body(prompt="p")
    assert decode_request(body, message_id="m", correlation_id="c").id == "m"
    msg = decode_request(body, correlation_id="c")
    assert msg.id == "c" and msg.correlation_id == "c"
    assert decode_request(_body(id="b", prompt="p"), message_id="m").id == "b"


def test_correlation_id_defaults_to_id_and_is_echoed():
    assert decode_request(_body(id="b", prompt="p")).correlation_id == "b"
    assert decode_request(_body(id="b", prompt="p"), correlation_id="c").correlation_id == "c"


def test_deadline_from_expiration_and_enqueue_time():
    ts = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    base = ts.timestamp()
    msg = decode_request(_body(id="x", prompt="p"), timestamp=ts, expiration=30.0)
    assert msg.deadline == pytest.approx(base + 30.0)
    # A raw AMQP expiration string is milliseconds.
    msg = decode_request(_body(id="x", prompt="p"), timestamp=base, expiration="1500")
    assert msg.deadline == pytest.approx(base + 1.5)
    # The earlier of the body's deadline and the expiration wins.
    msg = decode_request(_body(id="x", prompt="p", deadline=base + 5), timestamp=ts, expiration=30)
    assert msg.deadline == pytest.approx(base + 5)
    # Without any enqueue time the expiration counts from reception.
    msg = decode_request(_body(id="x", prompt="p"), expiration=10, received_at=100.0)
    assert msg.deadline == pytest.approx(110.0) and msg.enqueued_at is None


def test_enqueued_at_prefers_the_sub_second_header():
    ts = dt.datetime(2025, 1, 1, 12, 0, 0, tzinfo=dt.timezone.utc)
    base = ts.timestamp()
    plain = decode_request(_body(id="x", prompt="p"), timestamp=ts)
    assert plain.enqueued_at == base
    for header in (f"{base + 0.75:.6f}", base + 0.75):
        msg = decode_request(
            _body(id="x", prompt="p"), timestamp=ts, headers={"x-enqueued-at": header}
        )
        assert msg.enqueued_at == pytest.approx(base + 0.75)
    # The header alone is enough; a naive datetime is taken as UTC.
    msg = decode_request(_body(id="x", prompt="p"), headers={"x-enqueued-at": "12.5"})
    assert msg.enqueued_at == 12.5
    naive = decode_request(_body(id="x", prompt="p"), timestamp=ts.replace(tzinfo=None))
    assert naive.enqueued_at == base


def test_enqueued_at_ignores_a_header_that_disagrees_with_the_timestamp():
    # What a Python float header becomes after pamqp's 32-bit encoding: ~tens of s off.
    ts = 1_795_947_101.0
    msg = decode_request(
        _body(id="x", prompt="p"), timestamp=ts, headers={"x-enqueued-at": 1_795_947_136.0}
    )
    assert msg.enqueued_at == ts
    garbage = decode_request(_body(id="x", prompt="p"), headers={"x-enqueued-at": "soon"})
    assert garbage.enqueued_at is None


def test_enqueue_times_in_milliseconds_are_ignored():
    ms = 1_795_947_101_000.0  # a producer's milliseconds where seconds belong
    for props in ({"headers": {"x-enqueued-at": ms}}, {"timestamp": ms}):
        msg = decode_request(_body(id="x", prompt="p"), **props)
        assert msg.enqueued_at is None, props


def test_redelivery_and_delivery_count():
    msg = decode_request(
        _body(id="x", prompt="p"), redelivered=True, headers={"x-delivery-count": 2}
    )
    assert msg.redelivered and msg.delivery_count == 2
    assert decode_request(_body(id="x", prompt="p")).delivery_count is None


# -- refusals ------------------------------------------------------------------------------


def test_oversized_body_is_refused_with_what_can_be_recovered():
    err = _refused(
        _body(id="x", prompt="p" * 100),
        max_message_bytes=50,
        message_id="m",
        reply_to="rq",
        correlation_id="c",
    )
    assert "over the limit of 50" in err.message and "bytes" in err.message
    assert (err.request_id, err.reply_to, err.correlation_id) == ("m", "rq", "c")


def test_not_msgpack_not_a_map_and_wrong_content_type():
    assert "not valid msgpack" in _refused(b"\xc1", message_id="m").message
    assert "extra data" in _refused(_body(id="x", prompt="p") + b"\x01").message.lower()
    assert "must be a msgpack map, got array" in _refused(msgpack.packb([1, 2])).message
    err = _refused(_body(id="x", prompt="p"), content_type="application/json")
    assert "content_type must be 'application/msgpack'" in err.message


def test_missing_id():
    err = _refused(_body(prompt="p"), reply_to="rq")
    assert err.message.startswith("missing id")
    assert err.request_id is None and err.reply_to == "rq"


def test_id_must_be_a_short_string():
    assert "id must be a string, got integer 5" in _refused(_body(id=5, prompt="p")).message
    assert "over the limit of 255" in _refused(_body(id="x" * 256, prompt="p")).message


@pytest.mark.parametrize("bad", ["a\x00b", "line\nbreak", "tab\there"])
def test_id_must_be_printable(bad):
    err = _refused(_body(id=bad, prompt="p"), message_id="m")
    assert "id must be printable" in err.message
    assert err.request_id == "m"  # the error is recorded under the AMQP message_id
    # an unusable message_id is not used as the fallback either
    err = _refused(_body(prompt="p"), message_id=bad)
    assert "id must be printable" in err.message and err.request_id is None
    long = _refused(_body(prompt="p"), message_id="m" * 300)
    assert "over the limit" in long.message and long.request_id is None


def test_prompt_forms():
    err = _refused(_body(id="x"))
    assert err.message.startswith("no prompt") and err.request_id == "x"
    err = _refused(_body(id="x", prompt="p", prompt_token_ids=[1]))
    assert "exactly one of" in err.message and "prompt and prompt_token_ids" in err.message
    assert "prompt must be a string, got binary" in _refused(_body(id="x", prompt=b"p")).message
    err = _refused(_body(id="x", prompt_token_ids=[1, "2"]))
    assert "prompt_token_ids[1] must be an integer, got string '2'" in err.message
    err = _refused(_body(id="x", prompt_token_ids=[1, True]))
    assert "prompt_token_ids[1] must be an integer, got boolean" in err.message


@pytest.mark.parametrize(
    ("messages", "expected"),
    [
        ([], "messages must be a non-empty list"),
        ("hi", "messages must be a non-empty list of {role, content} maps, got string"),
        (["hi"], "messages[0] must be a map with role and content, got string"),
        ([{"role": "user"}], "messages[0] is missing 'content'"),
        ([{"role": "user", "content": 3}], "messages[0].content must be a string, got integer"),
        ([{"role": "user", "content": "a", "name": "n"}], "messages[0] has unknown key(s): name"),
    ],
)
def test_bad_messages(messages, expected):
    assert expected in _refused(_body(id="x", messages=messages)).message


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("max_tokens", "12", "max_tokens must be an integer, got string '12'"),
        ("max_tokens", 1.5, "max_tokens must be an integer, got float 1.5"),
        ("temperature", "hot", "temperature must be a number, got string 'hot'"),
        ("temperature", True, "temperature must be a number, got boolean True"),
        ("seed", 1.0, "seed must be an integer, got float"),
        ("ignore_eos", 1, "ignore_eos must be a boolean, got integer 1"),
        ("stop_token_ids", 2, "stop_token_ids must be a list of integers, got integer"),
        ("stop_token_ids", [2, "x"], "stop_token_ids[1] must be an integer"),
        ("stop", 5, "stop must be a string or a list of strings, got integer 5"),
        ("stop", ["a", 5], "stop[1] must be a string, got integer 5"),
        ("logprobs", [1], "logprobs must be an integer, got array"),
        ("priority", "high", "priority must be an integer, got string 'high'"),
        ("deadline", "tomorrow", "deadline must be a number, got string"),
        ("stream", "yes", "stream must be a boolean, got string 'yes'"),
        ("metadata", [1], "metadata must be a map, got array"),
    ],
)
def test_wrong_types_name_the_field_and_the_type(field, value, expected):
    err = _refused(_body(id="x", prompt="p", **{field: value}))
    assert expected in err.message and err.request_id == "x"


def test_unknown_fields_are_named():
    err = _refused(_body(id="x", prompt="p", tempreature=0.5, model="m"))
    assert err.message == "unknown field(s): model, tempreature"
    err = _refused(msgpack.packb({"id": "x", "prompt": "p", 1: 2}))
    assert "field names must be strings" in err.message


def test_metadata_limits():
    big = {"blob": "x" * MAX_METADATA_BYTES}
    err = _refused(_body(id="x", prompt="p", metadata=big))
    assert f"over the limit of {MAX_METADATA_BYTES}" in err.message
    err = _refused(_body(id="x", prompt="p", metadata={"a": {"b": b"raw"}}))
    assert "metadata.a.b must be JSON-compatible, got binary" in err.message
    err = _refused(msgpack.packb({"id": "x", "prompt": "p", "metadata": {1: "a"}}))
    assert "metadata keys must be strings" in err.message
    err = _refused(_body(id="x", prompt="p", metadata={"f": float("nan")}))
    assert "metadata.f must be a finite number" in err.message


def test_semantic_ranges_are_left_to_the_worker():
    msg = decode_request(_body(id="x", prompt="p", temperature=-1.0, max_tokens=0))
    assert msg.sampling == {"temperature": -1.0, "max_tokens": 0}


def test_encode_request_refuses_what_the_worker_would():
    with pytest.raises(InvalidRequest, match="exactly one of"):
        encode_request(id="x", prompt="p", prompt_token_ids=[1])
    with pytest.raises(InvalidRequest, match="unknown field"):
        encode_request(id="x", prompt="p", sampling={"beam_width": 4})
    with pytest.raises(ValueError, match="metadata is"):
        encode_request(id="x", prompt="p", metadata={"blob": "x" * 5000})


def test_default_size_limit_admits_a_long_prompt():
    body = _body(id="x", prompt="word " * 100_000)
    assert len(body) < DEFAULT_MAX_MESSAGE_BYTES
    assert decode_request(body).prompt is not None
