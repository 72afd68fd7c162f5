//! The admin API's OpenAPI description (`GET /api/openapi.json`, `src/admin/openapi.rs`) against
//! the real thing: every operation called on a running admin server over a real parking lot —
//! answers, jobs and errors alike — and each answer's status, content type and JSON checked
//! against what the description says for it; every documented status of every operation is
//! seen, except the server's own failures (500, 503). (`tests/api_fuzz.rs` lets schemathesis
//! drive the API from the same description.)

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use crate::common::*;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use regex::Regex;
use serde_json::{Value, json};

const ALICE: &str = "alice-token-0123456789";

/// Fast polls and one operator.
const ADMIN: &str =
    "[admin]\nbind = \"127.0.0.1:0\"\npoll_interval = \"100ms\"\n[admin.tokens]\nalice = \"alice-token-0123456789\"";

/// One tier and no retry to spare: `retry-attempt = 1` is parked at once as `max-attempts`;
/// with exact delays, so that a scheduled delivery can be cancelled.
const ONE_TIER: &str = "exact_delays = true\nbackoff = [\"100ms\"]\nmax_attempts = 1\nallow = [\"^{ns}-\"]";

/// Statuses the test cannot provoke from outside: the server's own failures.
const NOT_PROVOKED: [u16; 2] = [500, 503];

/// Checks answers against the description and remembers which `(method, path, status)` it saw.
struct Checker {
    spec: Value,
    http: reqwest::Client,
    base: String,
    seen: BTreeSet<(String, String, u16)>,
}

/// One request: method, the documented path, the concrete path and query, a body, a token.
struct Call<'a> {
    method: &'a str,
    template: &'a str,
    target: String,
    body: Option<Body>,
    token: Option<&'a str>,
    host: Option<&'a str>,
}

enum Body {
    Json(Value),
    Raw(&'static str, Vec<u8>),
}

impl<'a> Call<'a> {
    fn get(template: &'a str, target: impl Into<String>) -> Self {
        Call {
            method: "get",
            template,
            target: target.into(),
            body: None,
            token: None,
            host: None,
        }
    }

    fn post(template: &'a str, target: impl Into<String>, body: Value, token: Option<&'a str>) -> Self {
        Call {
            method: "post",
            template,
            target: target.into(),
            body: Some(Body::Json(body)),
            token,
            host: None,
        }
    }
}

impl Checker {
    /// Makes the call, checks the answer against the description and returns status and body.
    async fn call(&mut self, call: Call<'_>) -> (u16, Value, reqwest::header::HeaderMap) {
        let url = format!("{}{}", self.base, call.target);
        let mut request = self.http.request(call.method.to_uppercase().parse().unwrap(), &url);
        if let Some(token) = call.token {
            request = request.bearer_auth(token);
        }
        if let Some(host) = call.host {
            request = request.header("host", host);
        }
        request = match call.body {
            Some(Body::Json(v)) => request.json(&v),
            Some(Body::Raw(content_type, bytes)) => {
                let request = request.body(bytes);
                if content_type.is_empty() {
                    request
                } else {
                    request.header("content-type", content_type)
                }
            }
            None => request,
        };
        let response = request.send().await.unwrap_or_else(|e| panic!("{url}: {e}"));
        let status = response.status().as_u16();
        let headers = response.headers().clone();
        let content_type = headers
            .get("content-type")
            .map(|v| v.to_str().unwrap().to_string())
            .unwrap_or_default();
        let bytes = response.bytes().await.unwrap();
        let what = format!("{} {} → {status}", call.method.to_uppercase(), call.target);
        let operation = &self.spec["paths"][call.template][call.method];
        assert!(
            operation.is_object(),
            "{what}: {} {} is not described",
            call.method,
            call.template
        );
        let documented = self.resolve(&operation["responses"][status.to_string()]).clone();
        assert!(
            documented.is_object(),
            "{what}: status {status} is not documented: {}",
            String::from_utf8_lossy(&bytes)
        );
        self.seen
            .insert((call.method.to_string(), call.template.to_string(), status));
        let media = content_type.split(';').next().unwrap().trim().to_string();
        let content = &documented["content"];
        let schema = content[&media]["schema"].clone();
        assert!(
            schema.is_object(),
            "{what}: content type {content_type:?} is not documented: {content}"
        );
        for (name, _) in documented["headers"].as_object().into_iter().flatten() {
            assert!(
                headers.contains_key(name.as_str()),
                "{what}: documented header {name} missing"
            );
        }
        let value = if media == "application/json" {
            let value: Value = serde_json::from_slice(&bytes).unwrap_or_else(|e| panic!("{what}: not JSON: {e}"));
            let mut errors = vec![];
            self.check(&schema, &value, "$", &mut errors);
            assert!(
                errors.is_empty(),
                "{what}: the answer does not match its schema:\n{}\n{value:#}",
                errors.join("\n")
            );
            value
        } else {
            Value::String(String::from_utf8_lossy(&bytes).into_owned())
        };
        (status, value, headers)
    }

    fn resolve<'v>(&'v self, mut value: &'v Value) -> &'v Value {
        while let Some(reference) = value.get("$ref").and_then(Value::as_str) {
            value = self
                .spec
                .pointer(reference.strip_prefix('#').unwrap())
                .unwrap_or_else(|| panic!("{reference} resolves"));
        }
        value
    }

    /// The subset of OpenAPI 3.1's schema objects (JSON Schema 2020-12) the description uses,
    /// strictly.
    fn check(&self, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
        let schema = self.resolve(schema);
        if schema == &Value::Bool(false) {
            return errors.push(format!("{at}: {value} where nothing is allowed"));
        }
        for part in schema["allOf"].as_array().into_iter().flatten() {
            self.check(part, value, at, errors);
        }
        if let Some(options) = schema["oneOf"].as_array() {
            let passing = options
                .iter()
                .filter(|option| {
                    let mut e = vec![];
                    self.check(option, value, at, &mut e);
                    e.is_empty()
                })
                .count();
            if passing != 1 {
                errors.push(format!("{at}: {value} matches {passing} of oneOf {options:?}"));
            }
        }
        if let Some(allowed) = schema["enum"].as_array()
            && !allowed.contains(value)
        {
            errors.push(format!("{at}: {value} is not one of {allowed:?}"));
        }
        // `type` is one name or several (`["string", "null"]`): the value must be one of them
        let types: Vec<&str> = match &schema["type"] {
            Value::Array(names) => names.iter().filter_map(Value::as_str).collect(),
            Value::String(name) => vec![name.as_str()],
            _ => return,
        };
        let named = |value: &Value| match value {
            Value::Null => "null",
            Value::Bool(_) => "boolean",
            Value::Number(n) if n.is_i64() || n.is_u64() => "integer",
            Value::Number(_) => "number",
            Value::String(_) => "string",
            Value::Array(_) => "array",
            Value::Object(_) => "object",
        };
        let kind = named(value);
        match types
            .iter()
            .find(|t| **t == kind || (**t == "number" && kind == "integer"))
        {
            Some(t) => self.check_as(t, schema, value, at, errors),
            None => errors.push(format!("{at}: {value} is not of type {types:?}")),
        }
    }

    /// Checks `value`, of JSON type `kind`, against the rest of `schema`.
    fn check_as(&self, kind: &str, schema: &Value, value: &Value, at: &str, errors: &mut Vec<String>) {
        match kind {
            "object" => {
                let Some(object) = value.as_object() else {
                    return errors.push(format!("{at}: {value} is not an object"));
                };
                let properties = schema["properties"].as_object();
                for required in schema["required"].as_array().into_iter().flatten() {
                    if !object.contains_key(required.as_str().unwrap()) {
                        errors.push(format!("{at}: {required} is missing"));
                    }
                }
                for (key, item) in object {
                    let at = format!("{at}.{key}");
                    match properties.and_then(|p| p.get(key)) {
                        Some(property) => self.check(property, item, &at, errors),
                        None => match &schema["additionalProperties"] {
                            Value::Bool(false) => errors.push(format!("{at}: not documented")),
                            more @ Value::Object(_) => self.check(more, item, &at, errors),
                            _ => {}
                        },
                    }
                }
            }
            "array" => {
                let Some(items) = value.as_array() else {
                    return errors.push(format!("{at}: {value} is not an array"));
                };
                if schema["minItems"]
                    .as_u64()
                    .is_some_and(|min| (items.len() as u64) < min)
                    || schema["maxItems"]
                        .as_u64()
                        .is_some_and(|max| (items.len() as u64) > max)
                {
                    errors.push(format!("{at}: {} items", items.len()));
                }
                // the first items by position (a tuple), the rest by `items`
                let prefix = schema["prefixItems"].as_array().map_or(&[][..], Vec::as_slice);
                for (i, item) in items.iter().enumerate() {
                    let item_schema = prefix.get(i).unwrap_or(&schema["items"]);
                    if !item_schema.is_null() {
                        self.check(item_schema, item, &format!("{at}[{i}]"), errors);
                    }
                }
            }
            "string" => match value.as_str() {
                None => errors.push(format!("{at}: {value} is not a string")),
                Some(text) => {
                    if let Some(pattern) = schema["pattern"].as_str()
                        && !Regex::new(pattern).unwrap().is_match(text)
                    {
                        errors.push(format!("{at}: {text:?} does not match {pattern}"));
                    }
                }
            },
            "integer" => match value.as_i64().map(i128::from).or(value.as_u64().map(i128::from)) {
                None => errors.push(format!("{at}: {value} is not an integer")),
                Some(n) => {
                    if schema["minimum"].as_i64().is_some_and(|min| n < i128::from(min))
                        || schema["maximum"].as_i64().is_some_and(|max| n > i128::from(max))
                    {
                        errors.push(format!("{at}: {n} is out of range"));
                    }
                }
            },
            "number" | "boolean" | "null" => {}
            other => errors.push(format!("{at}: the checker knows no type {other}")),
        }
    }

    /// Every documented `(method, path, status)` not seen, apart from [`NOT_PROVOKED`].
    fn unseen(&self) -> Vec<(String, String, u16)> {
        let mut unseen = vec![];
        for (path, item) in self.spec["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                for status in operation["responses"].as_object().unwrap().keys() {
                    let status: u16 = status.parse().unwrap();
                    let key = (method.clone(), path.clone(), status);
                    if !NOT_PROVOKED.contains(&status) && !self.seen.contains(&key) {
                        unseen.push(key);
                    }
                }
            }
        }
        unseen
    }
}

/// Parks: 4 `max-attempts` to `queue`, 2 `no-destination`, 1 `invalid-header`, and 1 with a body
/// larger than an envelope takes (stored apart).
async fn park_mix(t: &TestLadder, queue: &str) {
    let publish = async |i: usize, extra: Vec<(&str, FieldValue)>, body: Vec<u8>| {
        let mut headers = FieldTable::default();
        headers.set("tenant", text(&format!("t{}", i % 2)));
        headers.set(
            "price",
            FieldValue::Decimal(ladder_amqp::Decimal { scale: 2, value: 1999 }),
        );
        for (k, v) in extra {
            headers.set(k, v);
        }
        let props = BasicProperties::default()
            .with_message_id(&format!("m-{i}"))
            .with_correlation_id("c-1")
            .with_headers(headers);
        t.publish(&t.intake(), "", &body, props).await;
    };
    let to_queue = || vec![("retry-to", text(queue)), ("retry-attempt", FieldValue::LongLongInt(1))];
    for i in 0..4 {
        publish(i, to_queue(), format!("{{\"order\": {i}}}").into_bytes()).await;
    }
    publish(4, vec![], b"no destination".to_vec()).await;
    publish(5, vec![], vec![0xff, 0xfe, 0x00]).await;
    publish(
        6,
        vec![("retry-to", text(queue)), ("retry-delay", text("soon"))],
        b"bad".to_vec(),
    )
    .await;
    publish(7, to_queue(), vec![b'x'; 1_100_000]).await;
    t.parked(8).await;
}

#[tokio::test]
async fn every_answer_of_the_admin_api_matches_its_openapi_description() {
    let mut t = TestLadder::configure_with("openapi", ADMIN, ONE_TIER).await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let queue = t.declare_queue("orders", FieldTable::default()).await;
    let http = reqwest::Client::builder().timeout(WAIT * 2).build().unwrap();
    let spec: Value = http
        .get(admin.url("/api/openapi.json"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let mut c = Checker {
        spec,
        http,
        base: admin.url(""),
        seen: BTreeSet::new(),
    };
    let l = t.ladder.clone();
    let parked = format!("/api/ladders/{l}/parked");

    // health, metrics, the description, the ladders (before and after the first poll)
    c.call(Call::get("/live", "/live")).await;
    c.call(Call::get("/ready", "/ready")).await;
    c.call(Call::get("/metrics", "/metrics")).await;
    c.call(Call::get("/api/openapi.json", "/api/openapi.json")).await;
    c.call(Call::get("/api/ladders", "/api/ladders")).await;
    park_mix(&t, &queue).await;
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, v, _) = c
            .call(Call::get("/api/ladders/{ladder}/parked", format!("{parked}?limit=0")))
            .await;
        let (_, ladders, _) = c.call(Call::get("/api/ladders", "/api/ladders")).await;
        if v["total"] == 8 && v["caught_up"] == true && ladders["ladders"][0]["rates"].is_object() {
            break;
        }
        assert!(Instant::now() < deadline, "never indexed and polled: {v}\n{ladders}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // reading
    let list = "/api/ladders/{ladder}/parked";
    let (_, page, _) = c.call(Call::get(list, parked.clone())).await;
    let offsets: Vec<u64> = page["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["offset"].as_u64().unwrap())
        .collect();
    let of = |id: &str| -> u64 {
        page["entries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|e| e["envelope"]["message"]["properties"]["message_id"] == id)
            .unwrap()["offset"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(offsets.len(), 8);
    c.call(Call::get(
        list,
        format!("{parked}?reason=max-attempts&header=tenant=t1&since=1h&limit=2&offset=1"),
    ))
    .await;
    c.call(Call::get(
        list,
        format!("{parked}?offsets={},{}&resolved=include", offsets[0], offsets[1]),
    ))
    .await;
    let counts = "/api/ladders/{ladder}/parked/counts";
    c.call(Call::get(counts, format!("{parked}/counts"))).await;
    c.call(Call::get(
        counts,
        format!("{parked}/counts?destination={queue}&body=order"),
    ))
    .await;
    let show = "/api/ladders/{ladder}/parked/{offset}";
    let body = "/api/ladders/{ladder}/parked/{offset}/body";
    for id in ["m-0", "m-5", "m-7"] {
        let (status, entry, _) = c.call(Call::get(show, format!("{parked}/{}", of(id)))).await;
        assert_eq!(status, 200);
        c.call(Call::get(body, format!("{parked}/{}/body", of(id)))).await;
        if id == "m-7" {
            assert!(
                entry["envelope"]["message"]["body_record"].is_object(),
                "stored apart: {entry}"
            );
        }
    }

    // edit and replay: one done, one answered before its job ends, and the refusals
    let edit = "/api/ladders/{ladder}/parked/{offset}/edit-replay";
    let edit_of = |id: &str| format!("{parked}/{}/edit-replay", of(id));
    let (status, edited, _) = c
        .call(Call::post(
            edit,
            edit_of("m-1"),
            json!({"set_headers": {"tenant": "t9"}, "body": "{\"order\": 1, \"fixed\": true}"}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(
        (status, edited["outcomes"][0]["status"].as_str()),
        (200, Some("replayed")),
        "{edited}"
    );
    let (_, entry, _) = c.call(Call::get(show, format!("{parked}/{}", of("m-1")))).await;
    assert_eq!(
        entry["resolution"]["edit"]["headers_changed"],
        json!(["tenant"]),
        "{entry}"
    );
    let (status, running, _) = c
        .call(Call::post(
            edit,
            edit_of("m-2"),
            json!({"body_base64": "eyJvcmRlciI6IDJ9Cg==", "wait": "0s"}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 202, "{running}");
    let one_job = "/api/ladders/{ladder}/parked/jobs/{id}";
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, view, _) = c
            .call(Call::get(one_job, running["status"].as_str().unwrap().to_string()))
            .await;
        if view["done"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "the edit never ended: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let change = json!({"set_headers": {"tenant": "t8"}});
    let (status, nothing, _) = c.call(Call::post(edit, edit_of("m-3"), json!({}), Some(ALICE))).await;
    assert_eq!(status, 400, "{nothing}");
    assert!(
        nothing["error"].as_str().unwrap().contains("changes nothing"),
        "{nothing}"
    );
    let (status, _, headers) = c.call(Call::post(edit, edit_of("m-3"), change.clone(), None)).await;
    assert_eq!((status, headers["www-authenticate"].to_str().unwrap()), (401, "Bearer"));
    c.call(Call::post(
        edit,
        edit_of("m-3"),
        change.clone(),
        Some("not-a-token-at-all-1234"),
    ))
    .await;
    c.call(Call::post(
        edit,
        format!("{parked}/999999/edit-replay"),
        change.clone(),
        Some(ALICE),
    ))
    .await;
    let mut unsupported = Call::post(edit, edit_of("m-3"), json!(null), Some(ALICE));
    unsupported.body = Some(Body::Raw("text/plain", change.to_string().into_bytes()));
    c.call(unsupported).await;
    let mut too_large = Call::post(edit, edit_of("m-3"), json!(null), Some(ALICE));
    too_large.body = Some(Body::Raw("application/json", vec![b' '; 300 * 1024]));
    c.call(too_large).await;

    // acting: a dry run with a failure in it, a replay, a job that outlives its request, a
    // conflict meanwhile, the jobs, a discard
    let replay = "/api/ladders/{ladder}/parked/replay";
    let discard = "/api/ladders/{ladder}/parked/discard";
    let (status, dry, _) = c
        .call(Call::post(
            replay,
            format!("{parked}/replay"),
            json!({"offsets": [of("m-0"), of("m-4")], "dry_run": true}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 200, "{dry}");
    assert_eq!(dry["outcomes"][1]["status"], "failed", "{dry}");
    let (status, done, _) = c
        .call(Call::post(
            replay,
            format!("{parked}/replay"),
            json!({"offsets": [of("m-0")]}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(
        (status, done["outcomes"][0]["status"].as_str()),
        (200, Some("replayed"))
    );
    let slow = json!({"reason": "max-attempts", "rate": "2/s", "wait": "0s"});
    let (status, job, headers) = c
        .call(Call::post(replay, format!("{parked}/replay"), slow, Some(ALICE)))
        .await;
    assert_eq!(status, 202, "{job}");
    assert_eq!(headers["location"].to_str().unwrap(), job["status"].as_str().unwrap());
    let (status, busy, _) = c
        .call(Call::post(
            discard,
            format!("{parked}/discard"),
            json!({"offsets": [of("m-4")]}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 409, "{busy}");
    let (status, busy, _) = c
        .call(Call::post(
            replay,
            format!("{parked}/replay"),
            json!({"offsets": [of("m-4")]}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 409, "{busy}");
    let (status, busy, _) = c
        .call(Call::post(
            edit,
            edit_of("m-4"),
            json!({"set_headers": {"tenant": "t7"}, "to": queue}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 409, "{busy}");
    c.call(Call::get("/api/ladders/{ladder}/parked/jobs", format!("{parked}/jobs")))
        .await;
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, view, _) = c
            .call(Call::get(one_job, job["status"].as_str().unwrap().to_string()))
            .await;
        if view["done"] == true {
            break;
        }
        assert!(Instant::now() < deadline, "the job never ended: {view}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (status, discarding, _) = c
        .call(Call::post(
            discard,
            format!("{parked}/discard"),
            json!({"reason": "no-destination", "wait": "0s"}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 202, "{discarding}");
    let deadline = Instant::now() + WAIT;
    loop {
        let (_, view, _) = c
            .call(Call::get(one_job, discarding["status"].as_str().unwrap().to_string()))
            .await;
        if view["done"] == true {
            assert_eq!(view["outcomes"].as_array().unwrap().len(), 2, "{view}");
            break;
        }
        assert!(Instant::now() < deadline, "the discard never ended: {view}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (status, discarded, _) = c
        .call(Call::post(
            discard,
            format!("{parked}/discard"),
            json!({"offsets": [of("m-6")]}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(
        (status, &discarded["outcomes"][0]["status"]),
        (200, &json!("discarded"))
    );
    let (_, all, _) = c.call(Call::get(list, format!("{parked}?resolved=include"))).await;
    let resolutions: BTreeSet<_> = all["entries"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|e| e["resolution"]["action"].as_str())
        .collect();
    assert_eq!(resolutions, BTreeSet::from(["discarded", "replayed"]), "{all}");

    // refusals, each as documented
    let nope = "/api/ladders/nope/parked";
    c.call(Call::get(list, format!("{parked}?limit=5000"))).await;
    c.call(Call::get(list, nope)).await;
    c.call(Call::get(counts, format!("{parked}/counts?since=someday")))
        .await;
    c.call(Call::get(counts, format!("{nope}/counts"))).await;
    c.call(Call::get(show, format!("{parked}/seven"))).await;
    c.call(Call::get(show, format!("{parked}/999999"))).await;
    c.call(Call::get(body, format!("{parked}/seven/body"))).await;
    c.call(Call::get(body, format!("{parked}/999999/body"))).await;
    c.call(Call::get("/api/ladders/{ladder}/parked/jobs", format!("{nope}/jobs")))
        .await;
    c.call(Call::get(one_job, format!("{parked}/jobs/x"))).await;
    c.call(Call::get(one_job, format!("{parked}/jobs/999999"))).await;
    for (template, target) in [
        (replay, format!("{parked}/replay")),
        (discard, format!("{parked}/discard")),
    ] {
        let by_offset = json!({"offsets": [of("m-6")]});
        let (status, _, headers) = c
            .call(Call::post(template, target.clone(), by_offset.clone(), None))
            .await;
        assert_eq!((status, headers["www-authenticate"].to_str().unwrap()), (401, "Bearer"));
        c.call(Call::post(
            template,
            target.clone(),
            by_offset.clone(),
            Some("not-a-token-at-all-1234"),
        ))
        .await;
        c.call(Call::post(template, target.clone(), json!({}), Some(ALICE)))
            .await;
        c.call(Call::post(
            template,
            target.replace(&format!("/{l}/"), "/nope/"),
            by_offset.clone(),
            Some(ALICE),
        ))
        .await;
        let mut unsupported = Call::post(template, target.clone(), json!(null), Some(ALICE));
        unsupported.body = Some(Body::Raw("text/plain", by_offset.to_string().into_bytes()));
        c.call(unsupported).await;
        let mut too_large = Call::post(template, target.clone(), json!(null), Some(ALICE));
        too_large.body = Some(Body::Raw("application/json", vec![b' '; 300 * 1024]));
        c.call(too_large).await;
    }
    // cancelling a scheduled delivery, and its refusals
    let cancel = "/api/ladders/{ladder}/scheduled/cancel";
    let cancel_at = format!("/api/ladders/{l}/scheduled/cancel");
    let by_id = json!({"message_id": "scheduled-1"});
    let (status, cancelled, _) = c
        .call(Call::post(cancel, cancel_at.clone(), by_id.clone(), Some(ALICE)))
        .await;
    assert_eq!((status, &cancelled["by"]), (200, &json!("alice")), "{cancelled}");
    c.call(Call::post(cancel, cancel_at.clone(), by_id.clone(), None)).await;
    c.call(Call::post(
        cancel,
        cancel_at.clone(),
        by_id.clone(),
        Some("not-a-token-at-all-1234"),
    ))
    .await;
    c.call(Call::post(cancel, cancel_at.clone(), json!({}), Some(ALICE)))
        .await;
    c.call(Call::post(
        cancel,
        "/api/ladders/nope/scheduled/cancel".to_string(),
        by_id.clone(),
        Some(ALICE),
    ))
    .await;
    let mut unsupported = Call::post(cancel, cancel_at.clone(), json!(null), Some(ALICE));
    unsupported.body = Some(Body::Raw("text/plain", by_id.to_string().into_bytes()));
    c.call(unsupported).await;
    let mut too_large = Call::post(cancel, cancel_at.clone(), json!(null), Some(ALICE));
    too_large.body = Some(Body::Raw("application/json", vec![b' '; 300 * 1024]));
    c.call(too_large).await;

    // the guards in front of every /api route: a Host this server does not serve, a long target
    let operations: Vec<(String, String)> = c.spec["paths"]
        .as_object()
        .unwrap()
        .iter()
        .filter(|(p, _)| p.starts_with("/api/"))
        .flat_map(|(p, item)| item.as_object().unwrap().keys().map(move |m| (m.clone(), p.clone())))
        .collect();
    for (method, template) in operations {
        let target = template
            .replace("{ladder}", &l)
            .replace("{offset}", "0")
            .replace("{id}", "0");
        let body = (method == "post").then(|| json!({"offsets": [0]}));
        for (target, host) in [
            (target.clone(), Some("rebinding.example")),
            (format!("{target}?x={}", "a".repeat(9000)), None),
        ] {
            let (status, v, _) = c
                .call(Call {
                    method: &method,
                    template: &template,
                    target,
                    body: body.clone().map(Body::Json),
                    token: Some(ALICE),
                    host,
                })
                .await;
            assert!(status == 400 || status == 414, "{method} {template}: {status} {v}");
        }
    }
    // the router's own refusals, outside the description: no such route, a method not taken
    for (method, target, status) in [
        ("GET", "/api/nothing".to_string(), 404),
        ("DELETE", format!("{parked}/1"), 405),
        ("PUT", format!("{parked}/replay"), 405),
    ] {
        let r = c
            .http
            .request(method.parse().unwrap(), admin.url(&target))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status().as_u16(), status, "{method} {target}");
        if status == 405 {
            assert!(r.headers().contains_key("allow"), "{method} {target}: Allow");
        }
        let v: Value = r.json().await.expect("an error under /api is JSON");
        assert!(v["error"].is_string() && v.as_object().unwrap().len() == 1, "{v}");
    }

    // destination holds: list, hold, resume, and their refusals
    let holds_t = "/api/ladders/{ladder}/holds";
    let resume_t = "/api/ladders/{ladder}/holds/resume";
    let holds = format!("/api/ladders/{l}/holds");
    let resume = format!("{holds}/resume");
    t.track_queue(&ladder::model::names::Names::new(&t.ns, &l).held_queue(&queue));
    let (status, _, _) = c
        .call(Call::post(
            holds_t,
            holds.clone(),
            json!({"destination": queue, "why": "w"}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 200);
    c.call(Call::get(holds_t, holds.clone())).await;
    c.call(Call::get(holds_t, "/api/ladders/nope/holds")).await;
    let (status, _, _) = c
        .call(Call::post(
            resume_t,
            resume.clone(),
            json!({"destination": queue, "rate": "50/s"}),
            Some(ALICE),
        ))
        .await;
    assert_eq!(status, 200);
    c.call(Call::post(
        resume_t,
        resume.clone(),
        json!({"destination": "never-held"}),
        Some(ALICE),
    ))
    .await;
    for (template, target, body) in [
        (holds_t, holds.clone(), json!({"destination": queue})),
        (resume_t, resume.clone(), json!({"destination": queue})),
    ] {
        c.call(Call::post(template, target.clone(), body.clone(), None)).await;
        c.call(Call::post(
            template,
            target.clone(),
            body.clone(),
            Some("not-a-token-at-all-1234"),
        ))
        .await;
        c.call(Call::post(template, target.clone(), json!({"nothing": 1}), Some(ALICE)))
            .await;
        c.call(Call::post(
            template,
            target.replace(&format!("/{l}/"), "/nope/"),
            body.clone(),
            Some(ALICE),
        ))
        .await;
        let mut unsupported = Call::post(template, target.clone(), json!(null), Some(ALICE));
        unsupported.body = Some(Body::Raw("text/plain", body.to_string().into_bytes()));
        c.call(unsupported).await;
        let mut too_large = Call::post(template, target.clone(), json!(null), Some(ALICE));
        too_large.body = Some(Body::Raw("application/json", vec![b' '; 300 * 1024]));
        c.call(too_large).await;
    }
    c.call(Call::post(
        holds_t,
        holds.clone(),
        json!({"destination": format!("{queue}-missing")}),
        Some(ALICE),
    ))
    .await;

    let unseen = c.unseen();
    assert!(unseen.is_empty(), "documented but never answered: {unseen:#?}");
    admin.stop().await;
}
