//! README stays true to what ships: every alert's runbook link lands on a runbook heading, every
//! metric the service exports is in the metrics table, and every route the OpenAPI description
//! names is in the "Over HTTP" table or the health endpoints'.

use std::collections::BTreeSet;

fn readme() -> String {
    std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap()
}

/// The anchor GitHub gives a heading: lowercase, punctuation dropped, spaces as hyphens.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

#[test]
fn every_alert_links_to_its_runbook_in_the_readme() {
    let anchors: BTreeSet<String> = readme()
        .lines()
        .filter_map(|l| l.strip_prefix('#'))
        .map(|l| slug(l.trim_start_matches('#')))
        .collect();
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/deploy/prometheus/ladder-alerts.yml");
    let rules: serde_json::Value = serde_norway::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let mut alerts = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let Some(alert) = rule["alert"].as_str() else { continue };
            alerts += 1;
            let link = rule["annotations"]["runbook"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert}: no runbook"));
            let anchor = link
                .strip_prefix("README.md#")
                .unwrap_or_else(|| panic!("{alert}: {link}"));
            assert_eq!(anchor, format!("runbook-{}", alert.to_lowercase()), "{alert}");
            assert!(
                anchors.contains(anchor),
                "README has no heading for #{anchor} ({alert})"
            );
        }
    }
    assert!(alerts >= 8, "the rules were read: {alerts}");
}

#[test]
fn every_exported_metric_is_in_the_readme_table() {
    let readme = readme();
    let documented: BTreeSet<&str> = readme
        .lines()
        .filter_map(|l| l.strip_prefix("| `ladder_"))
        .filter_map(|l| l.split('`').next())
        .collect();
    // a family shows in /metrics once it has a series: give every one of them one
    let dir = tempfile::tempdir().unwrap();
    let config_path = crate::common::write_config(
        dir.path(),
        "docs",
        "",
        "orders",
        "backoff = [\"1s\"]\nallow = [\"^orders$\"]",
    );
    let config = ladder::config::load(&config_path, &std::collections::HashMap::new()).unwrap();
    let metrics = ladder::metrics::Metrics::new();
    let _handles = metrics.ladder(&config.ladders[0]);
    metrics.set_queue_messages("orders", "intake", 0);
    let text = metrics.encode();
    let mut exported = BTreeSet::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ladder_") {
            let (name, kind) = rest.split_once(' ').unwrap();
            exported.insert(if kind == "counter" {
                format!("{name}_total")
            } else {
                name.to_string()
            });
        }
    }
    assert!(exported.len() >= 15, "{text}");
    let missing: Vec<_> = exported.iter().filter(|m| !documented.contains(m.as_str())).collect();
    let stale: Vec<_> = documented.iter().filter(|d| !exported.contains(**d)).collect();
    assert!(
        missing.is_empty(),
        "exported but not in README's metrics table: {missing:?}"
    );
    assert!(
        stale.is_empty(),
        "in README's metrics table but not exported: {stale:?}"
    );
}

#[test]
fn every_described_route_is_in_the_readme() {
    let readme = readme();
    let description = ladder::admin::openapi::description(&[]);
    for (path, item) in description["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            let row = format!("`{} {path}", method.to_uppercase());
            assert!(readme.contains(&row), "README documents no {row}`");
        }
    }
}
