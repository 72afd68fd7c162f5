//! The admin server's HTTP API described in OpenAPI 3.0, served at `GET /api/openapi.json`.
//!
//! Hand-written rather than derived: the answers' types live in other wings (the model's
//! envelope, the desk's jobs), which should not carry an HTTP library's derives, and the
//! limits it states come from the constants the handlers use, so they cannot drift. Two tests
//! keep it true: `tests` checks that every route of [`crate::admin::router`](fn@crate::admin::router) outside the web
//! page is described and every described route answers, and `tests/it/openapi.rs` checks real
//! answers from a running server against the schemas here (every operation, errors included).
//! `scripts/test` also lets schemathesis (PyPI) drive the API from this description.

use std::sync::Arc;

use axum::Json;
use axum::extract::State as Extract;
use serde_json::{Value, json};

use crate::admin::api::{DEFAULT_PAGE_SIZE, JOB_WAIT, MAX_PAGE_SIZE};
use crate::admin::state::AdminState;
use crate::broker::lot::MAX_ACTION_BATCH;

/// `GET /api/openapi.json`: the description for this server's ladders.
pub(crate) async fn serve(Extract(state): Extract<Arc<AdminState>>) -> Json<Value> {
    let ladders: Vec<&str> = state.config.ladders.iter().map(|l| l.name.as_str()).collect();
    Json(description(&ladders))
}

/// The whole description; `{ladder}` is one of `ladders` when any are given (a server names
/// its own, so a client or a fuzzer knows which exist).
pub fn description(ladders: &[&str]) -> Value {
    let mut description = json!({
        "openapi": "3.0.3",
        "info": {
            "title": "Ladder admin API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "Health, metrics, the ladders and their parking lots (docs/src/reference/http-api.md). \
                Every error under /api is {\"error\": \"...\"} JSON. Reading needs nothing; replay and \
                discard need Authorization: Bearer <token> with a token from admin.tokens.",
        },
        "paths": paths(),
        "components": {
            "schemas": schemas(),
            "parameters": parameters(),
            "responses": responses(),
            "securitySchemes": {
                "token": {
                    "type": "http",
                    "scheme": "bearer",
                    "description": "A token from the config's admin.tokens; its name is who asked.",
                },
            },
        },
    });
    if !ladders.is_empty() {
        description["components"]["parameters"]["ladder"]["schema"]["enum"] = json!(ladders);
    }
    description
}

fn paths() -> Value {
    let mut paths = json!({
        "/live": {"get": {
            "operationId": "live",
            "summary": "200 while the process runs",
            "responses": {"200": text("ok")},
        }},
        "/ready": {"get": {
            "operationId": "ready",
            "summary": "200 once the topology is declared and every consumer runs; 503 before, while reconnecting, while the broker blocks publishing (a resource alarm), while a hop is stalled, and after the drain",
            "responses": {"200": text("ready"), "503": text("`not ready: <why>`: `connecting`, or every reason that holds a connected service up, separated by `; `, e.g. `not ready: blocked: low on memory` or `not ready: stalled: <ladder>/<hop> no progress for Ns with work waiting`")},
        }},
        "/metrics": {"get": {
            "operationId": "metrics",
            "summary": "Prometheus metrics in the OpenMetrics text format",
            "responses": {"200": {
                "description": "the metrics (docs/src/operations/metrics.md#metrics)",
                "content": {"application/openmetrics-text": {"schema": {"type": "string"}}},
            }},
        }},
        "/api/openapi.json": {"get": {
            "operationId": "openapi",
            "summary": "this description",
            "responses": {"200": {
                "description": "OpenAPI 3.0",
                "content": {"application/json": {"schema": {"type": "object"}}},
            }},
        }},
        "/api/ladders": {"get": {
            "operationId": "ladders",
            "summary": "every ladder: config, queue names, latest depths, rates, totals and accounting",
            "responses": {"200": json_answer("the ladders", "Ladders")},
        }},
    });
    let parked = parked_paths();
    if let (Some(all), Value::Object(more)) = (paths.as_object_mut(), holds_paths()) {
        all.extend(more);
    }
    if let (Some(all), Value::Object(more)) = (paths.as_object_mut(), parked) {
        all.extend(more);
    }
    // what the guards in front of every /api route may answer: a Host the server does not serve
    // (400) or a request target longer than it accepts (414)
    for (path, item) in paths.as_object_mut().into_iter().flatten() {
        if !path.starts_with("/api/") {
            continue;
        }
        for operation in item.as_object_mut().into_iter().flatten().map(|(_, o)| o) {
            let responses = &mut operation["responses"];
            if responses.get("400").is_none() {
                responses["400"] = json!({"$ref": "#/components/responses/BadRequest"});
            }
            responses["414"] = json!({"$ref": "#/components/responses/UriTooLong"});
            // every write takes a token and a JSON body: the same refusals for each
            if operation.get("security").is_some() {
                let responses = &mut operation["responses"];
                responses["401"] = json!({
                    "description": "no bearer token",
                    "headers": {"WWW-Authenticate": {"schema": {"type": "string"}}},
                    "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
                });
                responses["403"] = error("the token matches none in admin.tokens (or none is configured)");
                responses["413"] = error("the body is too large");
                responses["415"] = error("the body is not Content-Type: application/json");
            }
        }
    }
    paths
}

/// A `text/plain` answer.
/// The parking lot's paths, and the cancellation of a scheduled delivery.
fn parked_paths() -> Value {
    merged(
        json!({
            "/api/ladders/{ladder}/parked": {"get": {
                "operationId": "listParked",
                "summary": "a page of parked entries matching the filters, newest first",
                "parameters": list_parameters(true),
                "responses": {
                    "200": json_answer("the page and how many match", "List"),
                    "400": {"$ref": "#/components/responses/BadRequest"},
                    "404": {"$ref": "#/components/responses/NotFound"},
                    "500": {"$ref": "#/components/responses/Internal"},
                    "503": {"$ref": "#/components/responses/Unavailable"},
                },
            }},
            "/api/ladders/{ladder}/parked/counts": {"get": {
                "operationId": "countParked",
                "summary": "how many entries match, in all, per reason and per destination",
                "parameters": list_parameters(false),
                "responses": {
                    "200": json_answer("the counts, largest first", "Counts"),
                    "400": {"$ref": "#/components/responses/BadRequest"},
                    "404": {"$ref": "#/components/responses/NotFound"},
                    "500": {"$ref": "#/components/responses/Internal"},
                    "503": {"$ref": "#/components/responses/Unavailable"},
                },
            }},
            "/api/ladders/{ladder}/parked/{offset}": {"get": {
                "operationId": "showParked",
                "summary": "one entry in full",
                "parameters": [{"$ref": "#/components/parameters/ladder"}, {"$ref": "#/components/parameters/offset"}],
                "responses": {
                    "200": json_answer("the entry", "Entry"),
                    "400": {"$ref": "#/components/responses/BadRequest"},
                    "404": {"$ref": "#/components/responses/NotFound"},
                    "500": {"$ref": "#/components/responses/Internal"},
                    "503": {"$ref": "#/components/responses/Unavailable"},
                },
            }},
            "/api/ladders/{ladder}/parked/{offset}/body": {"get": {
                "operationId": "parkedBody",
                "summary": "the original body of one entry, as bytes (also when it was parked apart)",
                "parameters": [{"$ref": "#/components/parameters/ladder"}, {"$ref": "#/components/parameters/offset"}],
                "responses": {
                    "200": {
                        "description": "the body",
                        "content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}},
                    },
                    "400": {"$ref": "#/components/responses/BadRequest"},
                    "404": {"$ref": "#/components/responses/NotFound"},
                    "500": {"$ref": "#/components/responses/Internal"},
                    "503": {"$ref": "#/components/responses/Unavailable"},
                },
            }},
            "/api/ladders/{ladder}/parked/replay": {"post": action(
                "replayParked",
                "republish the selected unresolved entries to their queue (or `to`), as a job",
            )},
            "/api/ladders/{ladder}/parked/{offset}/edit-replay": {"post": edit_replay()},
            "/api/ladders/{ladder}/parked/discard": {"post": action(
                "discardParked",
                "mark the selected unresolved entries as discarded, as a job",
            )},
        }),
        job_paths(),
    )
}

/// The jobs of replays and discards, and the cancellation of a scheduled delivery.
fn job_paths() -> Value {
    json!({
        "/api/ladders/{ladder}/scheduled/cancel": {"post": {
            "operationId": "cancelScheduled",
            "summary": "cancel a scheduled delivery by message id, for every replica",
            "description": "Records the cancellation in the ladder's stream `N.L.cancels`: a message with this \
                id that is still waiting is parked as `cancelled` when it is next handled (at the latest \
                when due) instead of delivered. Answered once the broker confirmed the record. The ladder \
                must have exact_delays.",
            "security": [{"token": []}],
            "parameters": [{"$ref": "#/components/parameters/ladder"}],
            "requestBody": {
                "required": true,
                "content": {"application/json": {"schema": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["message_id"],
                    "properties": {"message_id": {"type": "string", "minLength": 1, "maxLength": 255}},
                }}},
            },
            "responses": {
                "200": {"description": "the cancellation is recorded", "content": {"application/json": {"schema": {
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["ladder", "message_id", "by", "at_ms", "until_ms"],
                    "properties": {
                        "ladder": {"type": "string"},
                        "message_id": {"type": "string"},
                        "by": {"type": "string"},
                        "at_ms": count(),
                        "until_ms": count(),
                    },
                }}}},
                "400": {"$ref": "#/components/responses/BadRequest"},
                "404": {"$ref": "#/components/responses/NotFound"},
                "500": {"$ref": "#/components/responses/Internal"},
                "503": {"$ref": "#/components/responses/Unavailable"},
            },
        }},
        "/api/ladders/{ladder}/parked/jobs": {"get": {
            "operationId": "listJobs",
            "summary": "this server's replays and discards of the ladder, newest first (running, and the last 64 ended)",
            "parameters": [{"$ref": "#/components/parameters/ladder"}],
            "responses": {
                "200": {"description": "the jobs", "content": {"application/json": {"schema": {
                    "type": "array", "items": {"$ref": "#/components/schemas/Job"},
                }}}},
                "404": {"$ref": "#/components/responses/NotFound"},
            },
        }},
        "/api/ladders/{ladder}/parked/jobs/{id}": {"get": {
            "operationId": "showJob",
            "summary": "one job, running or among the last 64 ended",
            "parameters": [{"$ref": "#/components/parameters/ladder"}, {
                "name": "id", "in": "path", "required": true,
                "schema": {"type": "integer", "minimum": 0, "format": "int64"},
            }],
            "responses": {
                "200": json_answer("the job", "Job"),
                "400": {"$ref": "#/components/responses/BadRequest"},
                "404": {"$ref": "#/components/responses/NotFound"},
            },
        }},
    })
}

/// `a` with the members of object `b` added.
fn merged(mut a: Value, b: Value) -> Value {
    if let (Some(all), Value::Object(more)) = (a.as_object_mut(), b) {
        all.extend(more);
    }
    a
}

fn text(example: &str) -> Value {
    json!({"description": example, "content": {"text/plain": {"schema": {"type": "string"}, "example": example}}})
}

/// A JSON answer of schema `name`.
fn json_answer(description: &str, name: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": format!("#/components/schemas/{name}")}}},
    })
}

/// The listing's and the counts' query parameters (the counts take no paging).
fn list_parameters(paged: bool) -> Value {
    let mut list = vec![json!({"$ref": "#/components/parameters/ladder"})];
    for name in [
        "destination",
        "reason",
        "message_id",
        "correlation_id",
        "header",
        "body",
        "since",
        "until",
        "offsets",
        "resolved",
    ] {
        list.push(json!({"$ref": format!("#/components/parameters/{name}")}));
    }
    if paged {
        list.push(json!({"$ref": "#/components/parameters/page_offset"}));
        list.push(json!({"$ref": "#/components/parameters/limit"}));
    }
    Value::Array(list)
}

/// A replay or discard: a job, answered when it ends within `wait` or else with 202.
fn action(id: &str, summary: &str) -> Value {
    json!({
        "operationId": id,
        "summary": summary,
        "description": format!(
            "Acts on at most {MAX_ACTION_BATCH} unresolved entries, oldest first (the rest is \
             `left_over`); holds the ladder's operator lock until it ends. The request waits for \
             the job up to `wait` (default and at most {} s).",
            JOB_WAIT.as_secs()
        ),
        "security": [{"token": []}],
        "parameters": [{"$ref": "#/components/parameters/ladder"}],
        "requestBody": {
            "required": true,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Action"}}},
        },
        "responses": {
            "200": json_answer("the job ended: every outcome", "JobAnswer"),
            "202": {
                "description": "the job runs on: follow it at `Location` (also `status`)",
                "headers": {"Location": {"schema": {"type": "string"}, "description": "the job's URL"}},
                "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobAnswer"}}},
            },
            "400": {"$ref": "#/components/responses/BadRequest"},
            "404": {"$ref": "#/components/responses/NotFound"},
            "409": error("another replay or discard of the ladder runs"),
            "500": {"$ref": "#/components/responses/Internal"},
            "503": {"$ref": "#/components/responses/Unavailable"},
        },
    })
}

/// Edit one entry's headers or body, then replay it: a job of one entry.
fn edit_replay() -> Value {
    let mut op = action(
        "editReplayParked",
        "change one unresolved entry's headers or body, then republish it; the entry keeps the original",
    );
    op["description"] = json!(format!(
        "Replays the entry with the edit applied: `headers` replaces the original's (in the envelope's \
         typed form, as `GET …/parked/{{offset}}` shows them), then `set_headers` sets text values; \
         `body` (text) or `body_base64` replaces the body. The edit must change something, keep the \
         headers within limits.max_header_bytes and send the message to a queue the ladder allows \
         (`to`, else a `retry-to` the edit sets, else the recorded destination); else 400 with the \
         reason, before anything is sent. The entry is resolved as replayed, and its resolution's \
         `edit` names the caller's token, the header keys added, removed and changed, and the body's \
         length and SHA-256 before and after. The request waits for the job up to `wait` (default and \
         at most {} s).",
        JOB_WAIT.as_secs()
    ));
    op["parameters"] = json!([{"$ref": "#/components/parameters/ladder"}, {"$ref": "#/components/parameters/offset"}]);
    op["requestBody"]["content"]["application/json"]["schema"] = json!({"$ref": "#/components/schemas/Edit"});
    op["responses"]["409"] = error("another replay or discard of the ladder runs");
    op
}

/// The destination-hold routes (`src/admin/holds.rs`).
fn holds_paths() -> Value {
    json!({
        "/api/ladders/{ladder}/holds": {
            "get": {
                "operationId": "listHolds",
                "summary": "the held (or releasing) destinations, and the busiest this replica saw",
                "description": "Read from the ladder's stream `N.L.holds` up to a marker appended first, so a hold \
                    recorded through any replica is in the answer. `busiest` is this replica's own count of \
                    deliveries and failures back per destination over the breaker's window, and of the messages \
                    it put into a tier for the destination that are not due yet (`waiting`; tiers are shared \
                    by every destination, so this is counted from due times, in buckets a 32nd of each \
                    message's delay wide: a message may count up to ~3% of its delay too long, never too short).",
                "parameters": [{"$ref": "#/components/parameters/ladder"}],
                "responses": {
                    "200": {"description": "the holds", "content": {"application/json": {"schema": {
                        "type": "object",
                        "additionalProperties": false,
                        "required": ["ladder", "holds", "busiest", "recent", "window_ms"],
                        "properties": {
                            "ladder": {"type": "string"},
                            "window_ms": count(),
                            "holds": {"type": "array", "items": {
                                "type": "object",
                                "additionalProperties": false,
                                "required": ["destination", "state", "by", "why", "held_since_ms", "changed_at_ms", "held_queue", "messages"],
                                "properties": {
                                    "destination": {"type": "string"},
                                    "state": {"type": "string", "enum": ["held", "releasing"]},
                                    "by": {"type": "string"},
                                    "why": {"type": "string"},
                                    "held_since_ms": count(),
                                    "changed_at_ms": count(),
                                    "rate": {"type": "string"},
                                    "held_queue": {"type": "string"},
                                    "messages": {"type": "integer", "minimum": 0, "nullable": true},
                                },
                            }},
                            "recent": {"type": "array", "maxItems": crate::model::holds::MAX_RECENT, "items": {
                                "type": "object",
                                "additionalProperties": false,
                                "required": ["destination", "action", "by", "why", "at_ms"],
                                "properties": {
                                    "destination": {"type": "string"},
                                    "action": {"type": "string", "enum": ["held", "resumed", "released", "probed", "probe_failed", "deleted"]},
                                    "by": {"type": "string"},
                                    "why": {"type": "string"},
                                    "at_ms": count(),
                                    "rate": {"type": "string"},
                                },
                            }},
                            "busiest": {"type": "array", "maxItems": crate::admin::holds::BUSIEST, "items": {
                                "type": "object",
                                "additionalProperties": false,
                                "required": ["destination", "delivered", "failed", "waiting"],
                                "properties": {
                                    "destination": {"type": "string"},
                                    "delivered": count(),
                                    "failed": count(),
                                    "waiting": count(),
                                },
                            }},
                        },
                    }}}},
                    "400": {"$ref": "#/components/responses/BadRequest"},
                    "404": {"$ref": "#/components/responses/NotFound"},
                    "500": {"$ref": "#/components/responses/Internal"},
                    "503": {"$ref": "#/components/responses/Unavailable"},
                },
            },
            "post": hold_action(
                "holdDestination",
                "hold a destination queue for every replica: its due messages wait in `N.L.held.<queue>`, no attempt counted",
                json!({
                    "type": "object",
                    "additionalProperties": false,
                    "required": ["destination"],
                    "properties": {
                        "destination": {"type": "string", "minLength": 1, "maxLength": 255},
                        "why": {"type": "string"},
                    },
                }),
            ),
        },
        "/api/ladders/{ladder}/holds/resume": {"post": hold_action(
            "resumeDestination",
            "resume a held destination: its held queue is released at `rate` (default the ladder's release_rate), oldest first",
            json!({
                "type": "object",
                "additionalProperties": false,
                "required": ["destination"],
                "properties": {
                    "destination": {"type": "string", "minLength": 1, "maxLength": 255},
                    "rate": nullable(json!({"type": "string", "pattern": "^\\s*([0-9]+\\s*/\\s*[smh])?\\s*$",
                        "description": "N/s, N/m or N/h; left out, null or blank: the ladder's release_rate"})),
                },
            }),
        )},
    })
}

/// A hold or resume: answered once the broker confirmed the record in `N.L.holds`.
fn hold_action(id: &str, summary: &str, request: Value) -> Value {
    let mut action = json!({
        "operationId": id,
        "summary": summary,
        "description": "Recorded in the ladder's stream `N.L.holds`, which every replica follows; answered once \
            the broker confirmed the record. A hold is refused for a queue the ladder may not deliver to (400) \
            or that does not exist (404); a resume for a destination that is not held (409).",
        "security": [{"token": []}],
        "parameters": [{"$ref": "#/components/parameters/ladder"}],
        "requestBody": {
            "required": true,
            "content": {"application/json": {"schema": request}},
        },
        "responses": {
            "200": {"description": "recorded", "content": {"application/json": {"schema": {
                "type": "object",
                "additionalProperties": false,
                "required": ["ladder", "destination", "action", "by", "why", "at_ms"],
                "properties": {
                    "ladder": {"type": "string"},
                    "destination": {"type": "string"},
                    "action": {"type": "string", "enum": ["held", "resumed"]},
                    "by": {"type": "string"},
                    "why": {"type": "string"},
                    "at_ms": count(),
                    "rate": {"type": "string"},
                },
            }}}},
            "400": {"$ref": "#/components/responses/BadRequest"},
            "404": {"$ref": "#/components/responses/NotFound"},
            "409": error("the destination is not held"),
            "500": {"$ref": "#/components/responses/Internal"},
            "503": {"$ref": "#/components/responses/Unavailable"},
        },
    });
    // only a resume can find its destination not held
    if id != "resumeDestination"
        && let Some(responses) = action["responses"].as_object_mut()
    {
        responses.remove("409");
    }
    action
}

/// An error answer.
fn error(description: &str) -> Value {
    json!({
        "description": description,
        "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}},
    })
}

fn responses() -> Value {
    json!({
        "BadRequest": error("a path parameter, query or body that does not parse or is not allowed"),
        "NotFound": error("no such ladder, entry, job or route"),
        "Internal": error("a record in the stream does not decode"),
        "Unavailable": error("the broker is unreachable or did not answer in time"),
        "UriTooLong": error("the path and query are longer than the server accepts"),
    })
}

/// A string query parameter.
fn query(name: &str, description: &str) -> Value {
    json!({"name": name, "in": "query", "required": false, "description": description, "schema": {"type": "string"}})
}

fn parameters() -> Value {
    json!({
        "ladder": {
            "name": "ladder", "in": "path", "required": true, "description": "the ladder's name (its file stem)",
            "schema": {"type": "string"},
        },
        "offset": {
            "name": "offset", "in": "path", "required": true, "description": "the entry's stream offset",
            "schema": {"type": "integer", "minimum": 0, "format": "int64"},
        },
        "destination": query("destination", "the queue it was headed for"),
        "reason": query("reason", "the parking reason (`max-attempts`, `no-route`, …)"),
        "message_id": query("message_id", "the original message id"),
        "correlation_id": query("correlation_id", "the original correlation id"),
        "header": {
            "name": "header", "in": "query", "required": false, "style": "form", "explode": true,
            "description": "an original header's text value, `key=value`; repeatable, all must match",
            // as the server reads it: empty (ignored), or a non-empty key, `=` and any value
            "schema": {"type": "array", "items": {"type": "string", "pattern": "^(\\s*|[^=]+=[\\s\\S]*)$"}},
        },
        "body": query("body", "a substring of the (UTF-8) body"),
        "since": query("since", "parked at or after: RFC 3339, or a duration ago (`2h`)"),
        "until": query("until", "parked at or before: RFC 3339, or a duration ago (`10m`)"),
        "offsets": {
            "name": "offsets", "in": "query", "required": false,
            "description": "only these stream offsets, comma-separated",
            "schema": {"type": "string", "pattern": "^[\\s,]*(\\+?[0-9]+[\\s,]*)*$"},
        },
        "resolved": {
            "name": "resolved", "in": "query", "required": false,
            "description": "`include` (or `true`, `yes`, `on`): replayed and discarded entries too, with their \
                resolution; `false`, `no`, `off` or empty: unresolved ones only (the default)",
            "schema": {"type": "string", "enum": ["include", "true", "yes", "on", "false", "no", "off", ""]},
        },
        "page_offset": {
            "name": "offset", "in": "query", "required": false, "description": "newest matches to skip",
            "schema": {"type": "integer", "minimum": 0, "default": 0},
        },
        "limit": {
            "name": "limit", "in": "query", "required": false, "description": "entries to return",
            "schema": {"type": "integer", "minimum": 0, "maximum": MAX_PAGE_SIZE, "default": DEFAULT_PAGE_SIZE},
        },
    })
}

/// A non-negative integer.
fn count() -> Value {
    json!({"type": "integer", "minimum": 0})
}

/// A nullable schema.
fn nullable(mut schema: Value) -> Value {
    schema["nullable"] = json!(true);
    schema
}

/// A request's `wait` (a request field read as left out when `null`, as every `Option` one).
fn job_wait() -> Value {
    nullable(json!({"type": "string", "description": format!(
        "how long the request waits for the job, a duration (at most and by default {} s)",
        JOB_WAIT.as_secs()
    )}))
}

/// A request's `to`: another queue to send to.
fn other_queue() -> Value {
    nullable(json!({"type": "string", "description": "another queue; it must pass the ladder's allow list"}))
}

/// A closed object: these properties, all required unless listed in `optional`.
fn object(properties: Value, optional: &[&str]) -> Value {
    let required: Vec<&String> = properties
        .as_object()
        .map(|p| p.keys().filter(|k| !optional.contains(&k.as_str())).collect())
        .unwrap_or_default();
    json!({"type": "object", "additionalProperties": false, "required": required, "properties": properties})
}

/// `[[name, n], ..]`, largest first.
fn tallies() -> Value {
    json!({"type": "array", "items": {
        "type": "array", "minItems": 2, "maxItems": 2,
        "items": {"oneOf": [{"type": "string"}, {"type": "integer", "minimum": 0}]},
    }})
}

fn schemas() -> Value {
    let schemas = json!({
        "Error": object(json!({"error": {"type": "string"}}), &[]),
        "List": object(json!({
            "total": count(),
            "entries": {"type": "array", "items": {"$ref": "#/components/schemas/Entry"}},
            "indexed_entries": count(),
            "next_offset": nullable(count()),
            "caught_up": {"type": "boolean"},
        }), &[]),
        "Counts": object(json!({
            "total": count(),
            "by_reason": tallies(),
            "by_destination": tallies(),
            "indexed_entries": count(),
            "caught_up": {"type": "boolean"},
        }), &[]),
        "Entry": object(json!({
            "offset": count(),
            "envelope": {"$ref": "#/components/schemas/Envelope"},
            "resolution": {"allOf": [{"$ref": "#/components/schemas/Resolution"}], "nullable": true},
        }), &[]),
        "Envelope": object(json!({
            "format": {"type": "string", "enum": ["ladder.parked/v1"]},
            "reason": {"type": "string"},
            "detail": {"type": "string"},
            "ladder": {"type": "string"},
            "destination": nullable(json!({"type": "string"})),
            "attempts": nullable(count()),
            "first_failed_at_ms": nullable(count()),
            "history": {"type": "array", "items": object(json!({
                "attempt": count(),
                "tier": {"type": "string"},
                "failed_at_ms": count(),
            }), &[])},
            "replayed_from": {"type": "string"},
            "parked_at_ms": count(),
            "hop": {"type": "string", "enum": ["intake", "due", "quarantine"]},
            "message": {"$ref": "#/components/schemas/Message"},
        }), &["history", "replayed_from"]),
        "Message": object(json!({
            "exchange": {"type": "string"},
            "exchange_base64": {"type": "string"},
            "routing_key": {"type": "string"},
            "routing_key_base64": {"type": "string"},
            "properties": {
                "type": "object",
                "description": "the AMQP properties; headers with their exact AMQP types (docs/src/parking-lot/records.md#the-parked-envelope-ladderparkedv1)",
            },
            "body_base64": {"type": "string"},
            "body_record": object(json!({"id": {"type": "string"}, "bytes": count()}), &[]),
        }), &["exchange_base64", "routing_key_base64", "body_record"]),
        "Resolution": object(json!({
            "format": {"type": "string", "enum": ["ladder.resolution/v1"]},
            "resolves": count(),
            "action": {"type": "string", "enum": ["replayed", "discarded"]},
            "by": {"type": "string"},
            "at_ms": count(),
            "to": {"type": "string"},
            "edit": {"$ref": "#/components/schemas/EditAudit"},
        }), &["to", "edit"]),
        "EditAudit": {
            "type": "object",
            "additionalProperties": false,
            "description": "what an edit before replay changed: header keys, and the body's length and SHA-256",
            "properties": {
                "headers_added": {"type": "array", "items": {"type": "string"}},
                "headers_removed": {"type": "array", "items": {"type": "string"}},
                "headers_changed": {"type": "array", "items": {"type": "string"}},
                "body": object(json!({
                    "from_bytes": count(),
                    "from_sha256": {"type": "string"},
                    "to_bytes": count(),
                    "to_sha256": {"type": "string"},
                }), &[]),
            },
        },
        "Edit": {
            "type": "object",
            "additionalProperties": false,
            "description": "what to change before replaying one entry; at least one of headers, set_headers, \
                body, body_base64, and it must change something",
            "properties": {
                "headers": nullable(json!({"description": "the headers to replay with, replacing the original's, typed \
                    as the entry shows them: an object of {\"type\", \"value\"} (or an array of [key, value] pairs)",
                    "oneOf": [{"type": "object"}, {"type": "array"}]})),
                "set_headers": {"type": "object", "additionalProperties": {"type": "string"},
                    "description": "headers set to a text value, after headers"},
                "body": nullable(json!({"type": "string", "description": "the body as UTF-8 text"})),
                "body_base64": nullable(json!({"type": "string", "description": "the body as standard base64"})),
                "to": other_queue(),
                "wait": job_wait(),
            },
        },
    });
    merged(schemas, action_schemas())
}

/// A job's view ([`crate::admin::desk::JobView`]).
/// The schemas of replays, discards, jobs and cancellations.
fn action_schemas() -> Value {
    merged(
        json!({
            "Action": {
                "type": "object",
                "additionalProperties": false,
                "description": "Which entries — offsets and filter fields, all given must match; at least one is \
                    needed — and how. `to`, `rate` and `dry_run` are for a replay only.",
                "properties": {
                    "offsets": {"type": "array", "items": count()},
                    "destination": nullable(json!({"type": "string"})),
                    "reason": nullable(json!({"type": "string"})),
                    "message_id": nullable(json!({"type": "string"})),
                    "correlation_id": nullable(json!({"type": "string"})),
                    "headers": {"type": "object", "additionalProperties": {"type": "string"}},
                    "body_contains": nullable(json!({"type": "string"})),
                    "since": nullable(json!({"type": "string", "description": "RFC 3339, or a duration ago (`2h`)"})),
                    "until": nullable(json!({"type": "string", "description": "RFC 3339, or a duration ago (`10m`)"})),
                    "to": other_queue(),
                    "rate": nullable(json!({"type": "string", "description": "at most this many per second, minute or hour: `50/s`"})),
                    "dry_run": {"type": "boolean", "default": false},
                    "wait": job_wait(),
                },
            },
            "Outcome": object(json!({
                "offset": count(),
                "to": nullable(json!({"type": "string"})),
                "status": {"type": "string", "enum": ["replayed", "would-replay", "discarded", "failed"]},
                "error": {"type": "string", "description": "why it failed (status `failed` only)"},
            }), &["error"]),
            "Job": object(job_properties(), &[]),
            "JobAnswer": object(
                {
                    let mut properties = job_properties();
                    properties["job"] = count();
                    properties["status"] = json!({"type": "string", "description": "the job's URL, to poll"});
                    properties
                },
                &[],
            ),
        }),
        ladder_schemas(),
    )
}

/// The schemas of the ladders' list.
fn ladder_schemas() -> Value {
    json!({
        "Ladders": object(json!({
            "namespace": {"type": "string"},
            "poll_interval_ms": count(),
            "polled_at_ms": nullable(count()),
            "broker_error": nullable(json!({"type": "string"})),
            "ladders": {"type": "array", "items": {"$ref": "#/components/schemas/Ladder"}},
            "drift": nullable(object(json!({
                "read_at_ms": count(),
                "retired": {"type": "array", "description": "objects the namespace declared before that the config no longer uses and that still exist (the book's Changing a ladder)", "items": object(json!({
                    "name": {"type": "string"},
                    "kind": {"type": "string", "enum": ["queue", "exchange"]},
                    "ladder": {"type": "string"},
                    "role": {"type": "string", "description": "entry, intake, due, delay.<tier>, parked …"},
                    "ladder_retired": {"type": "boolean", "description": "no ladder file names its ladder any more"},
                    "stream": {"type": "boolean"},
                    "messages": count(),
                    "consumers": count(),
                    "last_due_by_ms": nullable(json!({"type": "integer", "minimum": 0, "format": "int64",
                        "description": "when the last message waiting in a retired tier is due at the latest (ms since the epoch)"})),
                    "note": {"type": "string"},
                }), &["last_due_by_ms"])},
                "differing": {"type": "array", "items": object(json!({
                    "name": {"type": "string"},
                    "kind": {"type": "string", "enum": ["queue", "exchange"]},
                    "detail": {"type": "string"},
                }), &[])},
            }), &[])),
        }), &[]),
        "Ladder": object(json!({
            "name": {"type": "string"},
            "exchange": {"type": "string"},
            "tiers": {"type": "array", "items": object(json!({
                "name": {"type": "string"},
                "delay_ms": count(),
                "queue": {"type": "string"},
                "step": {"type": "boolean", "description": "a backoff step; else a delay level, used by exact delays only"},
                "next_leave_at_ms": nullable(json!({"type": "integer", "minimum": 0, "format": "int64",
                    "description": "when the next message this process put into the tier leaves it (ms since the epoch, to a 1024th of the tier), at the latest poll; null when none it knows of waits"})),
                "put_in_waiting": nullable(json!({"type": "integer", "minimum": 0, "format": "int64",
                    "description": "how many messages this process put into the tier have not left yet (same estimate)"})),
                "shared_with": {"type": "array", "items": {"type": "string"},
                    "description": "the other ladders of the config whose messages wait in the same queue (tier queues are the namespace's, so its depth is theirs too); absent when none"},
            }), &["step", "shared_with"])},
            "max_attempts": count(),
            "allow": {"type": "array", "items": {"type": "string"}},
            "queue_type": {"type": "string", "enum": ["quorum", "classic"]},
            "dead_letter_strategy": {"type": "string", "enum": ["at-least-once", "at-most-once"]},
            "senders": {
                "type": "object",
                "description": "each sender (a broker user name) and the destination patterns it may target; only for a ladder that lists its senders",
                "additionalProperties": {"type": "array", "items": {"type": "string"}},
            },
            "unidentified": {
                "type": "string",
                "enum": ["reject", "dead-letter"],
                "description": "what a message from no listed sender may do; only with senders",
            },
            "queues": {"type": "object", "additionalProperties": {"type": "string"}},
            "depths": nullable(json!({"type": "object", "additionalProperties": nullable(count())})),
            "rates": nullable(object(json!({
                "received": {"type": "number"},
                "scheduled": {"type": "number"},
                "delivered": {"type": "number"},
                "parked": {"type": "number"},
                "window_ms": count(),
            }), &[])),
            "totals": nullable(object(json!({
                "entered": count(),
                "received_intake": count(),
                "refused_intake": count(),
                "received_due": count(),
                "refused_due": count(),
                "scheduled": count(),
                "delivered": count(),
                "parked": count(),
                "in_flight_intake": count(),
                "in_flight_due": count(),
                "in_flight_quarantine": count(),
            }), &[])),
            "accounting": nullable(object(json!({
                "verdict": {"type": "string", "enum": [
                    "unchecked", "busy", "anchored", "balanced", "suspect", "unaccounted", "in_doubt", "rebased"
                ]},
                "anchored": {"type": "boolean"},
                "missing": nullable(json!({"type": "integer"})),
                "unaccounted": count(),
                "in_doubt": count(),
            }), &[])),
        }), &["senders", "unidentified"]),
    })
}

fn job_properties() -> Value {
    json!({
        "id": count(),
        "ladder": {"type": "string"},
        "kind": {"type": "string", "enum": ["replay", "discard"]},
        "by": {"type": "string", "description": "the name of the token that asked"},
        "started_at_ms": count(),
        "selected": nullable(count()),
        "outcomes": {"type": "array", "items": {"$ref": "#/components/schemas/Outcome"}},
        "left_over": count(),
        "done": {"type": "boolean"},
        "error": nullable(json!({"type": "string"})),
    })
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, HashMap};
    use std::sync::Arc;

    use axum::body::Body;
    use axum::http::{Method, Request, StatusCode};
    use tower::ServiceExt;

    use super::*;
    use crate::admin::state::AdminState;
    use crate::broker::state::State;

    /// `(method, path)` of every route `router.rs` registers, read from its source: the router
    /// cannot list its routes, and a route added there without a description here must fail.
    fn registered_routes() -> BTreeSet<(String, String)> {
        let source = include_str!("router.rs");
        let source = &source[..source.find("#[cfg(test)]").unwrap_or(source.len())];
        let mut routes = BTreeSet::new();
        for (at, _) in source.match_indices(".route(") {
            let rest = &source[at + ".route(".len()..];
            let (mut depth, mut end) = (1, 0);
            for (i, c) in rest.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = i;
                    break;
                }
            }
            let call = &rest[..end];
            let path = call.split('"').nth(1).expect("a route's path is a string literal");
            let handlers = &call[call.find(',').expect("a route has handlers")..];
            for method in ["get", "post", "put", "patch", "delete"] {
                let called = handlers
                    .match_indices(&format!("{method}("))
                    .any(|(i, _)| i == 0 || !handlers[..i].ends_with(|c: char| c.is_alphanumeric() || c == '_'));
                if called {
                    routes.insert((method.to_string(), path.to_string()));
                }
            }
        }
        routes
    }

    fn described_routes() -> BTreeSet<(String, String)> {
        let description = description(&[]);
        let mut routes = BTreeSet::new();
        for (path, item) in description["paths"].as_object().unwrap() {
            for method in item.as_object().unwrap().keys() {
                routes.insert((method.clone(), path.clone()));
            }
        }
        routes
    }

    /// The web page's routes (and its stylesheet): for people, not part of the API.
    fn is_web_page(path: &str) -> bool {
        path == "/" || path.starts_with("/ladders/") || path.starts_with("/static/")
    }

    #[test]
    fn every_route_outside_the_web_page_is_described_and_nothing_else() {
        let registered = registered_routes();
        assert!(registered.len() > 10, "the router's source was read: {registered:?}");
        let registered: BTreeSet<_> = registered.into_iter().filter(|(_, p)| !is_web_page(p)).collect();
        let described = described_routes();
        let missing: Vec<_> = registered.difference(&described).collect();
        let extra: Vec<_> = described.difference(&registered).collect();
        assert!(
            missing.is_empty(),
            "routes without a description in openapi.rs: {missing:?}"
        );
        assert!(extra.is_empty(), "described routes the router does not have: {extra:?}");
    }

    #[test]
    fn every_reference_resolves_and_every_operation_has_an_id() {
        let description = description(&["orders"]);
        let mut references = vec![];
        fn walk(value: &Value, out: &mut Vec<String>) {
            match value {
                Value::Object(map) => {
                    if let Some(Value::String(r)) = map.get("$ref") {
                        out.push(r.clone());
                    }
                    map.values().for_each(|v| walk(v, out));
                }
                Value::Array(items) => items.iter().for_each(|v| walk(v, out)),
                _ => {}
            }
        }
        walk(&description, &mut references);
        assert!(references.len() > 20);
        for reference in references {
            let pointer = reference.strip_prefix('#').expect("local references only");
            assert!(description.pointer(pointer).is_some(), "{reference} resolves");
        }
        let mut ids = BTreeSet::new();
        for item in description["paths"].as_object().unwrap().values() {
            for operation in item.as_object().unwrap().values() {
                let id = operation["operationId"].as_str().expect("an operationId");
                assert!(ids.insert(id.to_string()), "{id} is unique");
            }
        }
    }

    /// Every request body's schema says `nullable` for exactly the fields its struct reads a
    /// `null` in as "left out": a field given as `null` is accepted where the description allows
    /// it and refused (400) where it does not, so a fuzzer or a client reading the description
    /// meets what the server does.
    #[test]
    fn request_fields_are_nullable_exactly_where_the_server_takes_a_null() {
        use crate::admin::api::{ActionRequest, CancelRequest, EditRequest};
        use crate::admin::holds::{HoldRequest, ResumeRequest};
        fn takes<T: serde::de::DeserializeOwned>(body: Value) -> bool {
            serde_json::from_value::<T>(body).is_ok()
        }
        let description = description(&["orders"]);
        let mut checked = 0;
        for item in description["paths"].as_object().unwrap().values() {
            for operation in item.as_object().unwrap().values() {
                let schema = &operation["requestBody"]["content"]["application/json"]["schema"];
                if schema.is_null() {
                    continue;
                }
                let schema = match schema["$ref"].as_str() {
                    Some(reference) => description.pointer(reference.strip_prefix('#').unwrap()).unwrap(),
                    None => schema,
                };
                let id = operation["operationId"].as_str().unwrap();
                // the least body each takes, its required fields given
                let (least, parse): (Value, fn(Value) -> bool) = match id {
                    "replayParked" | "discardParked" => (json!({}), takes::<ActionRequest>),
                    "editReplayParked" => (json!({}), takes::<EditRequest>),
                    "cancelScheduled" => (json!({"message_id": "m"}), takes::<CancelRequest>),
                    "holdDestination" => (json!({"destination": "q"}), takes::<HoldRequest>),
                    "resumeDestination" => (json!({"destination": "q"}), takes::<ResumeRequest>),
                    other => panic!("{other} has a request body this test does not know"),
                };
                assert!(parse(least.clone()), "{id} takes {least}");
                for (field, property) in schema["properties"].as_object().unwrap() {
                    let mut body = least.clone();
                    body[field] = Value::Null;
                    let said = property["nullable"] == json!(true);
                    assert_eq!(
                        parse(body),
                        said,
                        "{id}: `{field}: null` is taken iff the description says nullable ({said})"
                    );
                    checked += 1;
                }
            }
        }
        assert!(checked >= 30, "{checked} fields checked");
    }

    #[tokio::test]
    async fn every_described_route_answers_and_the_description_is_served() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("ladder.toml"), "namespace = \"ns\"\n").unwrap();
        std::fs::create_dir(dir.path().join("ladders")).unwrap();
        std::fs::write(
            dir.path().join("ladders/orders.toml"),
            "backoff = [\"1s\"]\nallow = [\"^orders$\"]\n",
        )
        .unwrap();
        let config = crate::config::load(&dir.path().join("ladder.toml"), &HashMap::new()).unwrap();
        let (_publish, snapshots) = tokio::sync::watch::channel(None);
        let state = Arc::new(AdminState::new(Arc::new(config), Arc::new(State::default()), snapshots));
        for (method, path) in described_routes() {
            // a ladder that does not exist: answered before the broker is asked
            let uri = path
                .replace("{ladder}", "nope")
                .replace("{offset}", "1")
                .replace("{id}", "1");
            let mut request = Request::builder()
                .method(Method::from_bytes(method.to_uppercase().as_bytes()).unwrap())
                .uri(&uri);
            if method == "post" {
                request = request.header("content-type", "application/json");
            }
            let body = if method == "post" {
                Body::from("{}")
            } else {
                Body::empty()
            };
            let response = crate::admin::router::router(state.clone())
                .oneshot(request.body(body).unwrap())
                .await
                .unwrap();
            assert_ne!(response.status(), StatusCode::METHOD_NOT_ALLOWED, "{method} {uri}");
            if response.status() == StatusCode::NOT_FOUND {
                let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
                let text = String::from_utf8_lossy(&body);
                assert!(text.contains("no ladder"), "{method} {uri} is routed: {text}");
            }
        }
        let response = crate::admin::router::router(state)
            .oneshot(Request::builder().uri("/api/openapi.json").body(Body::empty()).unwrap())
            .await
            .unwrap();
        assert_eq!(response.status(), StatusCode::OK);
        let body = axum::body::to_bytes(response.into_body(), 1 << 20).await.unwrap();
        let served: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(served, description(&["orders"]));
        assert_eq!(
            served["components"]["parameters"]["ladder"]["schema"]["enum"],
            json!(["orders"])
        );
    }
}
