"""The OpenAPI 3.1 description of the HTTP API (served at GET /openapi.json).

Hand-written rather than generated: the parameter bounds here are the ones the routes in
kvedit/server/http.py enforce (MAX_PAGE, MAX_CURSOR), and tests/server/test_http_fuzz.py draws its
requests from this document, so a route and its description cannot drift apart unnoticed.
"""
from __future__ import annotations

from kvedit import __version__

MAX_PAGE = 1000          # items per GET /cache page
MAX_CURSOR = 20          # characters of an `after` cursor (an integer < 2**63)
MAX_MODEL_PARAM = 1024   # characters of a `model` query parameter

_ERROR = {"type": "object", "required": ["error"],
          "properties": {"error": {"type": "string"}}}
_JSON_OBJ = {"type": "object"}


def _json(desc: str, schema: dict) -> dict:
    return {"description": desc, "content": {"application/json": {"schema": schema}}}


def _err(desc: str) -> dict:
    return _json(desc, {"$ref": "#/components/schemas/Error"})


_AUTH = [{"bearer": []}]
_MODEL = {"name": "model", "in": "query", "required": False,
          "description": "only this registered model",
          "schema": {"type": "string", "minLength": 1, "maxLength": MAX_MODEL_PARAM}}

SPEC: dict = {
    "openapi": "3.1.0",
    "info": {"title": "kvedit server", "version": __version__,
             "description": "Health, status, configuration, Prometheus metrics and the cache "
                            "listing of a kvedit server. When the server has a secret, "
                            "/status, /config and /cache need `Authorization: Bearer <secret>`."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": _ERROR,
            "CacheItem": {"type": "object", "required": ["key", "model", "tp_rank", "bytes",
                                                         "age_s", "leases", "kind"],
                          "properties": {"key": {"type": "string"}, "model": {"type": "string"},
                                         "tp_rank": {"type": "integer"},
                                         "bytes": {"type": "integer"},
                                         "age_s": {"type": "number"},
                                         "leases": {"type": "integer"},
                                         "kind": {"enum": ["kv", "queries"]}}},
            "CachePage": {"type": "object", "required": ["total", "limit", "items", "next_after"],
                          "properties": {
                              "total": {"type": "integer"}, "limit": {"type": "integer"},
                              "after": {"type": ["integer", "null"]},
                              "next_after": {"type": ["integer", "null"]},
                              "items": {"type": "array",
                                        "items": {"$ref": "#/components/schemas/CacheItem"}}}},
        },
    },
    "paths": {
        "/health": {"get": {
            "summary": "liveness; open without a secret",
            "responses": {"200": _json("ok", {"type": "object", "required": ["status"],
                                              "properties": {"status": {"const": "ok"},
                                                             "instance": {"type": "integer"}}})}}},
        "/status": {"get": {
            "summary": "pool, objects, leases, counters and registered models (O(1))",
            "security": _AUTH,
            "responses": {"200": _json("status", _JSON_OBJ), "401": _err("no or wrong secret")}}},
        "/config": {"get": {
            "summary": "the server's configuration (every flag)",
            "security": _AUTH,
            "responses": {"200": _json("config", _JSON_OBJ), "401": _err("no or wrong secret")}}},
        "/metrics": {"get": {
            "summary": "Prometheus text exposition (no keys or model names); open",
            "responses": {"200": {"description": "metrics",
                                  "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
        "/cache": {
            "get": {
                "summary": "one page of ready objects, in a stable order; follow next_after",
                "security": _AUTH,
                "parameters": [
                    _MODEL,
                    {"name": "after", "in": "query", "required": False,
                     "description": "the next_after of the previous page",
                     "schema": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1}},
                    {"name": "limit", "in": "query", "required": False,
                     "schema": {"type": "integer", "minimum": 1, "maximum": MAX_PAGE,
                                "default": 100}}],
                "responses": {"200": _json("a page", {"$ref": "#/components/schemas/CachePage"}),
                              "400": _err("bad parameter"), "401": _err("no or wrong secret"),
                              "404": _err("model not registered")}},
            "delete": {
                "summary": "delete every ready object (of one model); leased ones go at release",
                "security": _AUTH,
                "parameters": [_MODEL],
                "responses": {"200": _json("deleted", {
                    "type": "object", "required": ["deleted"],
                    "properties": {"deleted": {"type": "integer"},
                                   "model": {"type": ["string", "null"]}}}),
                              "400": _err("bad parameter"), "401": _err("no or wrong secret"),
                              "404": _err("model not registered")}}},
        "/openapi.json": {"get": {"summary": "this document",
                                  "responses": {"200": _json("OpenAPI 3.1", _JSON_OBJ)}}},
    },
}
