"""JSON schemas for the structured-output acceptance tests (tests/unit/decoding and the
benchmark): nested objects, arrays with bounds, enums, numbers with ranges, required and
optional properties, strings with patterns. Every string, array and number is bounded, so a
valid answer exists within a small token budget whatever the model."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "sum": {
        "type": "object",
        "properties": {"sum": {"type": "integer", "minimum": -1000, "maximum": 1000}},
        "required": ["sum"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
        "additionalProperties": False,
    },
    "bool_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "note": {"type": "null"}},
        "required": ["ok", "note"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
    "bounded_string": {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8}},
        "required": ["name"],
        "additionalProperties": False,
    },
    "int_range": {
        "type": "object",
        "properties": {
            "age": {"type": "integer", "minimum": 18, "maximum": 99},
            "score": {"type": "integer", "exclusiveMinimum": 0, "maximum": 5},
        },
        "required": ["age", "score"],
        "additionalProperties": False,
    },
    "array_bounds": {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"enum": ["a", "b", "c"]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    "optional": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 9},
            "label": {"type": "string", "maxLength": 4},
        },
        "required": ["id"],
        "additionalProperties": False,
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 6},
                    "role": {"enum": ["admin", "guest"]},
                },
                "required": ["name", "role"],
                "additionalProperties": False,
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "points": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "x": {"type": "integer", "minimum": 0, "maximum": 9},
                        "y": {"type": "integer", "minimum": 0, "maximum": 9},
                    },
                    "required": ["x", "y"],
                    "additionalProperties": False,
                },
                "maxItems": 2,
            }
        },
        "required": ["points"],
        "additionalProperties": False,
    },
    "any_of": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, {"enum": ["none"]}]
            }
        },
        "required": ["value"],
        "additionalProperties": False,
    },
}


def response_format(name: str) -> dict[str, Any]:
    """The OpenAI ``response_format`` for schema ``name`` (strict)."""
    return {
        "type": "json_schema",
        "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
    }
