"""Type checks of a request body's fields against contract v1 (ranges are the worker's)."""

from __future__ import annotations

import math
from typing import Any

from broker.messages.contract import (
    MAX_CLIENT_LENGTH,
    MAX_MESSAGES,
    MAX_METADATA_BYTES,
    MAX_METADATA_DEPTH,
    PROMPT_FIELDS,
    REQUEST_FIELDS,
    SAMPLING_FIELDS,
    FieldKind,
    pack,
)


def check_fields(data: dict[Any, Any]) -> dict[str, Any]:
    """Type-check everything but the id; returns RequestMessage keyword arguments."""
    bad_keys = [k for k in data if not isinstance(k, str)]
    if bad_keys:
        raise ValueError(f"field names must be strings, got {', '.join(map(repr, bad_keys))}")
    unknown = sorted(k for k in data if k not in REQUEST_FIELDS)
    if unknown:
        raise ValueError(f"unknown field(s): {', '.join(unknown)}")
    given = {k: v for k, v in data.items() if v is not None and k != "id"}

    forms = [k for k in PROMPT_FIELDS if k in given]
    if not forms:
        raise ValueError("no prompt: send one of 'prompt', 'messages' or 'prompt_token_ids'")
    if len(forms) > 1:
        raise ValueError(
            f"send exactly one of 'prompt', 'messages' or 'prompt_token_ids', got {' and '.join(forms)}"
        )
    out: dict[str, Any] = {}
    if "prompt" in given:
        out["prompt"] = _expect(given["prompt"], str, "prompt", "a string")
    if "messages" in given:
        out["messages"] = _messages(given["messages"])
    if "prompt_token_ids" in given:
        out["prompt_token_ids"] = _int_list(given["prompt_token_ids"], "prompt_token_ids")

    sampling: dict[str, Any] = {}
    for name, kind in SAMPLING_FIELDS.items():
        if name in given:
            sampling[name] = _sampling_value(name, kind, given[name])
    out["sampling"] = sampling
    if "priority" in given:
        out["priority"] = _integer(given["priority"], "priority")
    if "client" in given:
        out["client"] = client_name(given["client"], "client")
    if "deadline" in given:
        out["deadline"] = _number(given["deadline"], "deadline")
    if "stream" in given:
        out["stream"] = _expect(given["stream"], bool, "stream", "a boolean")
    if "metadata" in given:
        out["metadata"] = _metadata(given["metadata"])
    return out


def _sampling_value(name: str, kind: FieldKind, value: Any) -> Any:
    if kind == FieldKind.INT:
        return _integer(value, name)
    if kind == FieldKind.NUMBER:
        return _number(value, name)
    if kind == FieldKind.BOOL:
        return _expect(value, bool, name, "a boolean")
    if kind == FieldKind.INT_LIST:
        return _int_list(value, name)
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list):
        raise ValueError(f"stop must be a string or a list of strings, got {describe(value)}")
    for i, s in enumerate(value):
        if not isinstance(s, str):
            raise ValueError(f"stop[{i}] must be a string, got {describe(s)}")
    return list(value)


def _messages(value: Any) -> list[dict[str, str]]:
    if not isinstance(value, list) or not value:
        raise ValueError(
            f"messages must be a non-empty list of {{role, content}} maps, got {describe(value)}"
        )
    if len(value) > MAX_MESSAGES:
        raise ValueError(f"messages has {len(value)} entries, over the limit of {MAX_MESSAGES}")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(
                f"messages[{i}] must be a map with role and content, got {describe(m)}"
            )
        extra = sorted(str(k) for k in m if k not in ("role", "content"))
        if extra:
            raise ValueError(f"messages[{i}] has unknown key(s): {', '.join(extra)}")
        for key in ("role", "content"):
            if key not in m:
                raise ValueError(f"messages[{i}] is missing {key!r}")
            if not isinstance(m[key], str):
                raise ValueError(f"messages[{i}].{key} must be a string, got {describe(m[key])}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def _metadata(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"metadata must be a map, got {describe(value)}")
    _json_compatible(value, "metadata")
    size = len(pack(value))
    if size > MAX_METADATA_BYTES:
        raise ValueError(
            f"metadata is {size} bytes encoded, over the limit of {MAX_METADATA_BYTES}"
        )
    return value


def _json_compatible(value: Any, path: str, depth: int = 0) -> None:
    """Metadata is stored as JSON: string keys, no binary, no ext types, finite floats,
    nested at most MAX_METADATA_DEPTH deep."""
    if isinstance(value, (dict, list)) and depth >= MAX_METADATA_DEPTH:
        raise ValueError(f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep")
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{path} keys must be strings, got {describe(k)}")
            _json_compatible(v, f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _json_compatible(v, f"{path}[{i}]", depth + 1)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ValueError(f"{path} must be a finite number, got {value!r}")
    elif value is not None and not isinstance(value, (str, int, bool)):
        raise ValueError(f"{path} must be JSON-compatible, got {wire_type(value)}")


def client_name(value: Any, name: str) -> str:
    """A client's name: printable, 1 to MAX_CLIENT_LENGTH characters."""
    if not isinstance(value, str):
        raise ValueError(f"{name} must be a string, got {describe(value)}")
    if not 0 < len(value) <= MAX_CLIENT_LENGTH or not value.isprintable():
        raise ValueError(
            f"{name} must be printable text of 1 to {MAX_CLIENT_LENGTH} characters, got {value!r}"
        )
    return value


def _expect(value: Any, kind: type, name: str, wanted: str) -> Any:
    if not isinstance(value, kind):
        raise ValueError(f"{name} must be {wanted}, got {describe(value)}")
    return value


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {describe(value)}")
    return value


def _number(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {describe(value)}")
    return float(value)


def _int_list(value: Any, name: str) -> list[int]:
    if not isinstance(value, list):
        raise ValueError(f"{name} must be a list of integers, got {describe(value)}")
    for i, v in enumerate(value):
        _integer(v, f"{name}[{i}]")
    return value


def wire_type(value: Any) -> str:
    names = {
        bool: "boolean",
        int: "integer",
        float: "float",
        str: "string",
        bytes: "binary",
        list: "array",
        dict: "map",
        type(None): "nil",
    }
    return names.get(type(value), type(value).__name__)


def describe(value: Any) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{wire_type(value)} {text}"
