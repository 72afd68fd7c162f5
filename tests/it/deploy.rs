//! What deploy/ relies on from the service: every `ladder_*` series that the Grafana dashboard
//! (`deploy/grafana/ladder-dashboard.json`) and the alert rules
//! (`deploy/prometheus/ladder-alerts.yml`) query exists in `/metrics`, with the label values
//! they select, once a retry and a park went through the service on the real broker. And the
//! two files themselves: they parse, every alert carries its runbook, and the Kubernetes
//! PrometheusRule carries the same rules. (`scripts/check-deploy` checks the rest of deploy/.)

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use crate::common::*;
use ladder_amqp::{BasicProperties, FieldTable, FieldValue};
use regex::Regex;

fn deploy_file(path: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy").join(path)
}

fn read(path: &str) -> String {
    std::fs::read_to_string(deploy_file(path)).unwrap_or_else(|e| panic!("deploy/{path}: {e}"))
}

/// Every `expr` of the dashboard's panels, with the panel's title.
fn dashboard_queries() -> Vec<(String, String)> {
    let dash: serde_json::Value =
        serde_json::from_str(&read("grafana/ladder-dashboard.json")).expect("the dashboard is JSON");
    let mut out = vec![];
    for panel in dash["panels"].as_array().expect("panels") {
        if panel["type"] == "row" {
            continue;
        }
        let title = panel["title"].as_str().expect("a panel has a title");
        let targets = panel["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {title:?} has no targets"));
        assert!(!targets.is_empty(), "panel {title:?} has no queries");
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title:?}: a target without expr"));
            out.push((title.to_string(), expr.to_string()));
        }
    }
    out
}

/// The alert rules: (alert name, the rule as YAML).
fn alert_rules(groups: &serde_norway::Value) -> Vec<(String, serde_norway::Value)> {
    let mut out = vec![];
    for group in groups.as_sequence().expect("groups is a list") {
        for rule in group["rules"].as_sequence().expect("a group has rules") {
            let name = rule["alert"].as_str().expect("every rule is an alert").to_string();
            out.push((name, rule.clone()));
        }
    }
    out
}

fn rules_file() -> serde_norway::Value {
    serde_norway::from_str(&read("prometheus/ladder-alerts.yml")).expect("the rules file is YAML")
}

/// Every query of the dashboard and the rules: (where, PromQL).
fn all_queries() -> Vec<(String, String)> {
    let mut queries: Vec<_> = dashboard_queries()
        .into_iter()
        .map(|(title, expr)| (format!("dashboard panel {title:?}"), expr))
        .collect();
    for (name, rule) in alert_rules(&rules_file()["groups"]) {
        let expr = rule["expr"].as_str().expect("an alert has an expr").to_string();
        queries.push((format!("alert {name}"), expr));
    }
    queries
}

/// A `ladder_*` selector in a query: the metric name and its label matchers (label, op, value).
#[derive(Debug)]
struct Selector {
    name: String,
    matchers: Vec<(String, String, String)>,
}

fn selectors(expr: &str) -> Vec<Selector> {
    let selector = Regex::new(r"\b(ladder_[a-z0-9_]+)\b(?:\s*\{([^}]*)\})?").unwrap();
    let matcher = Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*"((?:[^"\\]|\\.)*)""#).unwrap();
    selector
        .captures_iter(expr)
        .map(|c| Selector {
            name: c[1].to_string(),
            matchers: c.get(2).map_or(vec![], |m| {
                matcher
                    .captures_iter(m.as_str())
                    // PromQL strings are Go-escaped: `"delay\\..+"` is the regex `delay\..+`
                    .map(|m| (m[1].to_string(), m[2].to_string(), m[3].replace(r"\\", r"\")))
                    .collect()
            }),
        })
        .collect()
}

#[test]
fn the_dashboard_and_the_rules_parse_and_cover_what_operators_need() {
    let queries = dashboard_queries();
    let used: BTreeSet<String> = queries.iter().flat_map(|(_, e)| selectors(e)).map(|s| s.name).collect();
    // the panels the issue asks for, by the series they need
    for name in [
        "ladder_received_messages_total",
        "ladder_scheduled_messages_total",
        "ladder_delivered_messages_total",
        "ladder_parked_messages_total",
        "ladder_deferred_messages_total",
        "ladder_queue_messages",
        "ladder_lateness_seconds_bucket",
        "ladder_hop_duration_seconds_bucket",
        "ladder_unaccounted_messages",
        "ladder_reconnects_total",
        "ladder_in_flight_messages",
    ] {
        assert!(
            used.contains(name),
            "no dashboard panel queries {name}; it queries {used:?}"
        );
    }
    let quantiles: BTreeSet<_> = queries
        .iter()
        .filter(|(_, e)| e.contains("ladder_lateness_seconds_bucket"))
        .filter_map(|(_, e)| e.strip_prefix("histogram_quantile(")?.split(',').next())
        .collect();
    assert_eq!(quantiles, BTreeSet::from(["0.5", "0.99"]), "lateness p50 and p99");

    let rules = rules_file();
    let alerts = alert_rules(&rules["groups"]);
    let names: BTreeSet<_> = alerts.iter().map(|(n, _)| n.as_str()).collect();
    for name in [
        "LadderUnaccountedMessages",
        "LadderParkedRateHigh",
        "LadderLatenessHigh",
        "LadderDown",
        "LadderAbsent",
        "LadderReconnectStorm",
        "LadderDeferralsSustained",
    ] {
        assert!(names.contains(name), "no alert {name} in {names:?}");
    }
    for (name, rule) in &alerts {
        assert_eq!(
            rule["annotations"]["runbook"].as_str(),
            Some(format!("docs/src/operations/runbooks.md#runbook-{}", name.to_lowercase()).as_str()),
            "{name}: runbook annotation"
        );
        assert!(rule["annotations"]["summary"].as_str().is_some(), "{name}: summary");
        assert!(
            matches!(rule["labels"]["severity"].as_str(), Some("warning" | "critical")),
            "{name}: severity"
        );
        assert!(rule["for"].as_str().is_some(), "{name}: a `for` duration");
    }

    // the Kubernetes PrometheusRule carries exactly these groups
    let prometheus_rule: serde_norway::Value =
        serde_norway::from_str(&read("kubernetes/prometheusrule.yaml")).expect("the PrometheusRule is YAML");
    assert_eq!(prometheus_rule["kind"].as_str(), Some("PrometheusRule"));
    assert_eq!(prometheus_rule["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    assert!(
        prometheus_rule["spec"]["groups"] == rules["groups"],
        "deploy/kubernetes/prometheusrule.yaml differs from deploy/prometheus/ladder-alerts.yml: run scripts/check-deploy --write"
    );
}

#[test]
fn selectors_are_read_from_promql() {
    let s = selectors(
        r#"sum by (ladder) (rate(ladder_parked_messages_total{ladder=~"$ladder", queue=~"delay\\..+", hop="due"}[5m])) / ladder_reconnects_total"#,
    );
    assert_eq!(s.len(), 2);
    assert_eq!(s[0].name, "ladder_parked_messages_total");
    assert_eq!(
        s[0].matchers,
        [
            ("ladder".into(), "=~".into(), "$ladder".into()),
            ("queue".into(), "=~".into(), r"delay\..+".into()),
            ("hop".into(), "=".into(), "due".into()),
        ]
    );
    assert_eq!(s[1].name, "ladder_reconnects_total");
    assert!(s[1].matchers.is_empty());
}

/// One sample of the exposition: name and labels.
struct Sample {
    name: String,
    labels: BTreeMap<String, String>,
}

/// Samples and `# TYPE` lines (family → type) of an OpenMetrics text.
fn parse_exposition(text: &str) -> (Vec<Sample>, BTreeMap<String, String>) {
    let label = Regex::new(r#"([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)""#).unwrap();
    let (mut samples, mut types) = (vec![], BTreeMap::new());
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (family, kind) = rest.split_once(' ').expect("# TYPE name type");
            types.insert(family.to_string(), kind.to_string());
            continue;
        }
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        let end = line.find(['{', ' ']).expect("a sample line");
        let labels = match line[end..].strip_prefix('{') {
            Some(rest) => label
                .captures_iter(&rest[..rest.find('}').expect("closing brace")])
                .map(|c| (c[1].to_string(), c[2].to_string()))
                .collect(),
            None => BTreeMap::new(),
        };
        samples.push(Sample {
            name: line[..end].to_string(),
            labels,
        });
    }
    (samples, types)
}

/// The family a sample name belongs to and the type it must have.
fn family_of(name: &str) -> (&str, &[&str]) {
    for suffix in ["_bucket", "_sum", "_count"] {
        if let Some(family) = name.strip_suffix(suffix) {
            return (family, &["histogram"]);
        }
    }
    if let Some(family) = name.strip_suffix("_total") {
        return (family, &["counter"]);
    }
    (name, &["gauge", "counter", "unknown"])
}

/// Labels Prometheus attaches to a target (or kube-state-metrics has), never in the exposition.
const TARGET_LABELS: [&str; 4] = ["job", "instance", "namespace", "pod"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_metric_the_dashboard_and_the_alerts_use_exists() {
    let mut t = TestLadder::configure_with(
        "deploy",
        "[admin]\npoll_interval = \"100ms\"",
        "backoff = [\"200ms\", \"10m\"]\nmax_attempts = 2\nallow = [\"^{ns}-\"]\n",
    )
    .await;
    t.start_service().await;
    let admin = TestAdmin::start(t.config.clone(), t.state.clone()).await;
    let orders = t.declare_queue("orders", FieldTable::default()).await;
    let mut consumer = t.consume(&orders).await;

    // one retry through the 200ms tier back to orders, and one park (a destination not allowed)
    let props = |to: &str| {
        let mut headers = FieldTable::default();
        headers.set("retry-to", FieldValue::string(to));
        BasicProperties::default().with_headers(headers)
    };
    t.publish(&t.intake(), "", b"retry me", props(&orders)).await;
    t.publish(&t.intake(), "", b"park me", props("elsewhere")).await;
    let d = next(&mut consumer).await;
    assert_eq!(d.body, b"retry me");
    consumer.ack(&d);

    let url = admin.url("/metrics");
    let want = [
        "ladder_delivered_messages_total{ladder=\"default\"} 1",
        "ladder_parked_messages_total{ladder=\"default\",reason=\"destination-not-allowed\"} 1",
        "ladder_queue_messages{ladder=\"default\",queue=\"parked\"}",
        "ladder_queue_messages{ladder=\"default\",queue=\"delay.10m\"}",
        "ladder_queue_messages{ladder=\"default\",queue=\"intake\"}",
        "ladder_queue_messages{ladder=\"default\",queue=\"due\"}",
    ];
    let text = eventually_ok(&format!("/metrics has {want:?}"), WAIT, async || {
        let response = reqwest::get(&url).await.expect("GET /metrics");
        assert_eq!(response.status(), 200);
        let text = response.text().await.unwrap();
        if want.iter().all(|w| text.lines().any(|l| l.starts_with(w))) {
            Ok(text)
        } else {
            Err(text)
        }
    })
    .await;

    let (samples, types) = parse_exposition(&text);
    let mut problems = vec![];
    let mut checked = BTreeSet::new();
    for (place, expr) in all_queries() {
        for s in selectors(&expr) {
            checked.insert(s.name.clone());
            let (family, kinds) = family_of(&s.name);
            match types.get(family) {
                Some(kind) if kinds.contains(&kind.as_str()) => {}
                Some(kind) => problems.push(format!("{place}: {} — {family} is a {kind}, not a {kinds:?}", s.name)),
                None => problems.push(format!("{place}: {} — no metric family {family} in /metrics", s.name)),
            }
            let of_name: Vec<_> = samples.iter().filter(|x| x.name == s.name).collect();
            if of_name.is_empty() {
                problems.push(format!("{place}: no series {} in /metrics", s.name));
                continue;
            }
            for (label, op, value) in &s.matchers {
                if value.contains('$') || TARGET_LABELS.contains(&label.as_str()) {
                    continue; // a Grafana variable, or a label the scrape adds
                }
                let matches: Box<dyn Fn(&str) -> bool> = match op.as_str() {
                    "=" => Box::new(|v: &str| v == value),
                    "=~" => {
                        let re = Regex::new(&format!("^(?:{value})$")).expect("a regex matcher");
                        Box::new(move |v: &str| re.is_match(v))
                    }
                    _ => continue, // negative matchers select nothing in particular
                };
                if !of_name.iter().any(|x| x.labels.get(label).is_some_and(|v| matches(v))) {
                    problems.push(format!(
                        "{place}: no series {}{{{label}{op}\"{value}\"}} in /metrics",
                        s.name
                    ));
                }
            }
        }
    }
    assert!(
        problems.is_empty(),
        "the dashboard or the alert rules query what the service does not export:\n{}\n\n/metrics:\n{text}",
        problems.join("\n")
    );
    // and it did look at them all
    assert!(checked.len() >= 14, "checked only {checked:?}");
    admin.stop().await;
}
