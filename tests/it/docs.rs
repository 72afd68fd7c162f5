//! The book (`docs/src/`, built with mdBook) and README stay true to what ships:
//!
//! - every relative link lands: on a file that exists and, for a page of the book, on one of its
//!   headings (mdBook's anchor rules); every page is in `SUMMARY.md`;
//! - every alert's runbook link lands on a runbook heading;
//! - the references are checked against the code: every metric the service exports is in the
//!   metrics table (and no other), every route of the OpenAPI description in the HTTP API
//!   chapter (and no other), every config key the config structs accept in the configuration
//!   chapter (and no other), every protocol header and parking reason in the protocol chapter;
//! - every `ladder …` command in a shell block parses with the real binary; every other command
//!   of a shell block, and every code span of the prose that starts with a known command, holds
//!   the check [`CHECKS`] names for it, offline and without a cluster (`rabbitmqctl help SUB`,
//!   the admin router's routes, the deploy files `scripts/check-deploy` validates, the
//!   workspace's packages …), and a command no check knows fails the test;
//! - the pages of the book the code points at (`docs/src/….md#anchor`) exist, and the
//!   troubleshooting chapter quotes messages the code has.
//!
//! `scripts/test` runs the link check once more right after `mdbook build docs`. The link check
//! is this test rather than mdbook-linkcheck, which checks that a linked file exists but not its
//! `#anchor` (its issue #52); the anchor rules here match mdBook 0.5.4's output on every page.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn book_src() -> PathBuf {
    root().join("docs/src")
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A page of the book as mdBook renders it: `{{#include FILE}}` lines replaced by the file.
fn page(path: &Path) -> String {
    let mut out = String::new();
    for line in read(path).lines() {
        match line
            .trim()
            .strip_prefix("{{#include ")
            .and_then(|l| l.strip_suffix("}}"))
        {
            Some(included) => out.push_str(&read(&path.parent().unwrap().join(included.trim()))),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// A page of the book by its path under `docs/src`.
fn chapter(relative: &str) -> String {
    page(&book_src().join(relative))
}

/// Every Markdown file under `docs/src`.
pub(crate) fn book_pages() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "md") {
                out.push(path);
            }
        }
    }
    let mut out = vec![];
    walk(&book_src(), &mut out);
    out.sort();
    assert!(out.len() >= 20, "the book's pages were found: {out:?}");
    out
}

/// The lines of `text` outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut out = vec![];
    for (i, line) in text.lines().enumerate() {
        if line.trim_start().starts_with("```") {
            fenced = !fenced;
            continue;
        }
        if !fenced {
            out.push((i + 1, line));
        }
    }
    out
}

/// The anchor mdBook gives a heading: the text without inline-code backticks, letters and digits
/// lowercased, `-` and `_` kept, white space as `-`, everything else dropped.
fn heading_id(heading: &str) -> String {
    heading
        .replace('`', "")
        .trim()
        .chars()
        .filter_map(|c| {
            if c.is_alphanumeric() || c == '_' || c == '-' {
                Some(c.to_ascii_lowercase())
            } else if c.is_whitespace() {
                Some('-')
            } else {
                None
            }
        })
        .collect()
}

/// The anchors of a page: one per heading, a repeated one numbered `-1`, `-2` … as mdBook does.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let id = heading_id(&line[hashes..]);
        let n = seen.entry(id.clone()).or_insert(0);
        out.insert(if *n == 0 { id.clone() } else { format!("{id}-{n}") });
        *n += 1;
    }
    out
}

/// The targets of the inline links `[text](target)` in the prose of `text`, with their line
/// numbers; code spans are skipped.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = vec![];
    let mut ticks = 0; // the length of the backtick run that opened the code span we are in
    for (number, line) in prose(text) {
        let bytes = line.as_bytes();
        let mut i = 0;
        while i < bytes.len() {
            if bytes[i] == b'`' {
                let run = bytes[i..].iter().take_while(|&&b| b == b'`').count();
                if ticks == 0 {
                    ticks = run;
                } else if ticks == run {
                    ticks = 0;
                }
                i += run;
                continue;
            }
            if ticks == 0 && bytes[i..].starts_with(b"](") {
                let rest = &line[i + 2..];
                if let Some(end) = rest.find(')') {
                    out.push((number, rest[..end].to_string()));
                }
            }
            i += 1;
        }
    }
    out
}

/// The problems with the relative links of `file` (a page of the book when `in_book`).
fn broken_links(file: &Path, text: &str, in_book: bool) -> Vec<String> {
    let mut broken = vec![];
    let here = file.strip_prefix(root()).unwrap().display().to_string();
    for (line, target) in links(text) {
        if target.contains("://") || target.starts_with("mailto:") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((path, anchor)) => (path, Some(anchor)),
            None => (target.as_str(), None),
        };
        let resolved = if path.is_empty() {
            file.to_path_buf()
        } else {
            file.parent().unwrap().join(path)
        };
        let Ok(resolved) = resolved.canonicalize() else {
            broken.push(format!("{here}:{line}: {target}: no such file"));
            continue;
        };
        let is_markdown = resolved.extension().is_some_and(|e| e == "md");
        let book = book_src().canonicalize().unwrap();
        if in_book && is_markdown && !resolved.starts_with(&book) {
            // mdBook turns it into a link to an .html file that is not in the book
            broken.push(format!(
                "{here}:{line}: {target}: a page outside docs/src (name it in text, or include it)"
            ));
            continue;
        }
        if let Some(anchor) = anchor {
            if !is_markdown {
                broken.push(format!(
                    "{here}:{line}: {target}: an anchor into a file that is not Markdown"
                ));
            } else if !anchors(&page(&resolved)).contains(anchor) {
                broken.push(format!("{here}:{line}: {target}: no heading #{anchor} there"));
            }
        }
    }
    broken
}

/// Every relative link of the book, README, BENCHMARKS.md and ARCHITECTURE.md lands on a
/// file that exists and on a heading of it; every page of the book is in `SUMMARY.md` and every
/// chapter `SUMMARY.md` names exists. `scripts/test` runs this right after `mdbook build docs`.
#[test]
fn book_links_land() {
    let mut broken = vec![];
    for file in book_pages() {
        broken.extend(broken_links(&file, &page(&file), true));
    }
    for file in ["README.md", "BENCHMARKS.md", "ARCHITECTURE.md", "examples/README.md"] {
        let path = root().join(file);
        broken.extend(broken_links(&path, &read(&path), false));
    }
    let summary = book_src().join("SUMMARY.md");
    let listed: BTreeSet<PathBuf> = links(&read(&summary))
        .into_iter()
        .map(|(_, target)| book_src().join(target))
        .collect();
    for file in book_pages() {
        if file != summary && !listed.contains(&file) {
            broken.push(format!("{}: not in SUMMARY.md", file.display()));
        }
    }
    for file in &listed {
        if !file.exists() {
            broken.push(format!("SUMMARY.md names {}, which does not exist", file.display()));
        }
    }
    assert!(broken.is_empty(), "broken links:\n{}", broken.join("\n"));
}

/// Every page of the book the code names (`docs/src/operations/runbooks.md#runbook-…` in the web
/// page, the OpenAPI description's pointers) exists and has the heading named.
#[test]
fn the_code_points_at_pages_of_the_book() {
    fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                out.push(path);
            }
        }
    }
    let mut files = vec![];
    sources(&root().join("src"), &mut files);
    let reference = regex::Regex::new(r"docs/src/([A-Za-z0-9_/.-]+\.md)(#[a-z0-9_-]+)?").unwrap();
    let (mut found, mut broken) = (0, vec![]);
    for file in files {
        let text = read(&file);
        for m in reference.captures_iter(&text) {
            found += 1;
            let page_path = book_src().join(&m[1]);
            let here = file.strip_prefix(root()).unwrap().display();
            if !page_path.is_file() {
                broken.push(format!("{here}: {}: no such page", &m[0]));
            } else if let Some(anchor) = m.get(2)
                && !anchors(&page(&page_path)).contains(&anchor.as_str()[1..])
            {
                broken.push(format!("{here}: {}: no such heading", &m[0]));
            }
        }
    }
    assert!(found >= 4, "the references were found: {found}");
    assert!(broken.is_empty(), "{broken:#?}");
}

/// The link checker itself: mdBook's anchors, and a broken link of each kind is caught.
#[test]
fn the_link_checker_catches_what_is_broken() {
    assert_eq!(
        heading_id("The parked envelope (`ladder.parked/v1`)"),
        "the-parked-envelope-ladderparkedv1"
    );
    assert_eq!(heading_id("Runbook: LadderDown"), "runbook-ladderdown");
    assert_eq!(
        heading_id("With RabbitMQ 4.3's own delayed retry"),
        "with-rabbitmq-43s-own-delayed-retry"
    );
    let twice = anchors("# A\n## Same\n```\n# not a heading\n```\n## Same\n");
    assert_eq!(twice, BTreeSet::from(["a".into(), "same".into(), "same-1".into()]));
    let page = book_src().join("protocol.md");
    let text = "[ok](concepts/topology.md#topology) [ok](#parking-reasons) `[code](nowhere.md)`\n\
                [gone](nowhere.md) [no anchor](concepts/topology.md#nowhere) [outside](../../SECURITY.md)\n";
    let broken = broken_links(&page, text, true);
    assert_eq!(broken.len(), 3, "{broken:#?}");
    assert!(broken[0].contains("nowhere.md: no such file"), "{broken:#?}");
    assert!(broken[1].contains("no heading #nowhere"), "{broken:#?}");
    assert!(broken[2].contains("a page outside docs/src"), "{broken:#?}");
}

#[test]
fn every_alert_links_to_its_runbook_in_the_book() {
    let runbooks = anchors(&chapter("operations/runbooks.md"));
    let path = root().join("deploy/prometheus/ladder-alerts.yml");
    let rules: serde_json::Value = serde_norway::from_str(&read(&path)).unwrap();
    let mut alerts = 0;
    for group in rules["groups"].as_array().unwrap() {
        for rule in group["rules"].as_array().unwrap() {
            let Some(alert) = rule["alert"].as_str() else { continue };
            alerts += 1;
            let link = rule["annotations"]["runbook"]
                .as_str()
                .unwrap_or_else(|| panic!("{alert}: no runbook"));
            let anchor = link
                .strip_prefix("docs/src/operations/runbooks.md#")
                .unwrap_or_else(|| panic!("{alert}: {link}"));
            assert_eq!(anchor, format!("runbook-{}", alert.to_lowercase()), "{alert}");
            assert!(
                runbooks.contains(anchor),
                "the runbooks have no heading #{anchor} ({alert})"
            );
        }
    }
    assert!(alerts >= 8, "the rules were read: {alerts}");
}

/// The first column of every table row of `text` that starts with a code span, split at `, `:
/// `` | `a`, `b` | … `` gives `a` and `b`.
fn first_column_names(text: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let Some(row) = line.strip_prefix("| `") else { continue };
        let cell = row.split(" |").next().unwrap();
        for name in format!("`{cell}").split(", ") {
            if let Some(name) = name.strip_prefix('`').and_then(|n| n.strip_suffix('`')) {
                out.insert(name.to_string());
            }
        }
    }
    out
}

/// The part of `text` from the heading `from` to the next heading of the same level or higher.
fn section<'a>(text: &'a str, from: &str) -> &'a str {
    let start = text
        .find(&format!("\n{from}\n"))
        .unwrap_or_else(|| panic!("no heading {from}"))
        + 1;
    let level = from.chars().take_while(|&c| c == '#').count();
    let rest = &text[start + from.len()..];
    let end = rest
        .match_indices("\n#")
        .find(|(i, _)| {
            let hashes = rest[i + 1..].chars().take_while(|&c| c == '#').count();
            hashes <= level && rest[i + 1 + hashes..].starts_with(' ')
        })
        .map_or(rest.len(), |(i, _)| i);
    &rest[..end]
}

#[test]
fn every_exported_metric_is_in_the_metrics_table() {
    let page = chapter("operations/metrics.md");
    let documented: BTreeSet<String> = first_column_names(section(&page, "## Metrics"))
        .into_iter()
        .filter(|name| name.starts_with("ladder_"))
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
                format!("ladder_{name}_total")
            } else {
                format!("ladder_{name}")
            });
        }
    }
    assert!(exported.len() >= 15, "{text}");
    let missing: Vec<_> = exported.difference(&documented).collect();
    let stale: Vec<_> = documented.difference(&exported).collect();
    assert!(missing.is_empty(), "exported but not in the metrics table: {missing:?}");
    assert!(stale.is_empty(), "in the metrics table but not exported: {stale:?}");
}

/// The HTTP API chapter lists exactly the routes of the OpenAPI description, and points at the
/// description for the rest.
#[test]
fn the_http_chapter_lists_the_described_routes() {
    let page = chapter("reference/http-api.md");
    assert!(
        page.contains("`GET /api/openapi.json`"),
        "the chapter points at the description"
    );
    let listed = first_column_names(&page);
    let description = ladder::admin::openapi::description(&[]);
    let mut described = BTreeSet::new();
    for (path, item) in description["paths"].as_object().unwrap() {
        for method in item.as_object().unwrap().keys() {
            described.insert(format!("{} {path}", method.to_uppercase()));
        }
    }
    assert!(described.len() >= 15, "{described:?}");
    let missing: Vec<_> = described.difference(&listed).collect();
    let stale: Vec<_> = listed.difference(&described).collect();
    assert!(
        missing.is_empty(),
        "described but not in the HTTP API chapter: {missing:?}"
    );
    assert!(stale.is_empty(), "in the HTTP API chapter but not described: {stale:?}");
}

/// The keys a config table accepts, from the config loader's own refusal of an unknown key
/// (`unknown field `zz_unknown`, expected one of `a`, `b`, …`).
fn accepted_keys(main: &str, ladder: &str) -> Vec<String> {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("ladder.toml"), main).unwrap();
    std::fs::create_dir_all(dir.path().join("ladders")).unwrap();
    std::fs::write(dir.path().join("ladders/l.toml"), ladder).unwrap();
    let error = ladder::config::load(&dir.path().join("ladder.toml"), &Default::default())
        .err()
        .unwrap_or_else(|| panic!("an unknown key is refused:\n{main}\n{ladder}"))
        .to_string();
    let expected = error
        .split_once("expected one of ")
        .unwrap_or_else(|| panic!("the error names the keys: {error}"))
        .1;
    // a nested table's error ends in "for key `amqp.tls`"
    let expected = expected.split(" for key ").next().unwrap();
    let keys: Vec<String> = expected.split('`').skip(1).step_by(2).map(str::to_string).collect();
    assert!(!keys.is_empty(), "{error}");
    keys
}

/// Every key the config structs accept is in the configuration chapter, and the chapter names no
/// key they refuse.
#[test]
fn the_configuration_chapter_names_every_key_and_no_other() {
    const LADDER: &str = "backoff = [\"1s\"]\nallow = [\"^orders$\"]\n";
    let prefixed =
        |prefix: &str, keys: Vec<String>| -> Vec<String> { keys.into_iter().map(|k| format!("{prefix}{k}")).collect() };
    let mut accepted = BTreeSet::new();
    for key in accepted_keys("zz_unknown = 1\n", LADDER) {
        if key != "amqp" && key != "admin" {
            accepted.insert(key);
        }
    }
    for key in prefixed("amqp.", accepted_keys("[amqp]\nzz_unknown = 1\n", LADDER)) {
        if key != "amqp.tls" {
            accepted.insert(key);
        }
    }
    accepted.extend(prefixed(
        "amqp.tls.",
        accepted_keys("[amqp.tls]\nzz_unknown = 1\n", LADDER),
    ));
    accepted.extend(prefixed("admin.", accepted_keys("[admin]\nzz_unknown = 1\n", LADDER)));
    let mut ladder_keys = BTreeSet::new();
    for key in accepted_keys("", &format!("zz_unknown = 1\n{LADDER}")) {
        if key != "auto_hold" {
            ladder_keys.insert(key);
        }
    }
    ladder_keys.extend(prefixed(
        "auto_hold.",
        accepted_keys("", &format!("{LADDER}[auto_hold]\nzz_unknown = 1\n")),
    ));
    assert!(
        accepted.len() >= 20 && ladder_keys.len() >= 15,
        "{accepted:?} {ladder_keys:?}"
    );

    let page = chapter("reference/configuration.md");
    for (heading, accepted) in [
        ("## The service: `ladder.toml`", &accepted),
        ("## A ladder: `ladders/<name>.toml`", &ladder_keys),
    ] {
        let documented = first_column_names(section(&page, heading));
        let missing: Vec<_> = accepted.difference(&documented).collect();
        let stale: Vec<_> = documented.difference(accepted).collect();
        assert!(missing.is_empty(), "accepted but not under {heading}: {missing:?}");
        assert!(stale.is_empty(), "under {heading} but refused by the config: {stale:?}");
    }
}

/// Every header of `protocol::header` and every parking reason is specified in the protocol
/// chapter; its reasons table names no other reason.
#[test]
fn the_protocol_chapter_specifies_every_header_and_reason() {
    use ladder::model::protocol::{ParkReason, header};
    let page = chapter("protocol.md");
    let rows = first_column_names(&page);
    for name in header::ALL {
        if name.starts_with("x-") {
            assert!(
                page.contains(&format!("`{name}`")),
                "the protocol chapter names no {name}"
            );
        } else {
            assert!(
                rows.contains(*name),
                "the protocol chapter has no row for the header {name}"
            );
        }
    }
    let reasons: BTreeSet<String> = ParkReason::ALL.iter().map(|r| r.to_string()).collect();
    let documented = first_column_names(section(&page, "## Parking reasons"));
    assert_eq!(documented, reasons, "the parking reasons table against ParkReason::ALL");
}

mod commands;

/// The command reference has a row for every subcommand the binary has.
#[test]
fn the_command_reference_lists_every_subcommand() {
    let output = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .arg("--help")
        .output()
        .unwrap();
    assert!(output.status.success());
    let help = String::from_utf8(output.stdout).unwrap();
    let subcommands: Vec<&str> = help
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("\n\n")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|&c| c != "help")
        .collect();
    assert!(subcommands.len() >= 10, "{help}");
    let rows: Vec<String> = first_column_names(&chapter("reference/cli.md")).into_iter().collect();
    for sub in subcommands {
        assert!(
            rows.iter()
                .any(|r| r == &format!("ladder {sub}") || r.starts_with(&format!("ladder {sub} "))),
            "the command reference has no row for `ladder {sub}`"
        );
    }
}

/// The topology chapter's count of a ladder's queues is what `ladder plan` prints for the shipped
/// config.
#[test]
fn the_topology_chapter_counts_the_shipped_ladders_queues() {
    let page = chapter("concepts/topology.md");
    let stated: usize = page
        .split("that is ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the chapter says `that is N queues`");
    let output = Command::new(env!("CARGO_BIN_EXE_ladder"))
        .args(["plan", "--config"])
        .arg(root().join("ladder.toml"))
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let plan = String::from_utf8(output.stdout).unwrap();
    let queues = plan.lines().filter(|l| l.starts_with("queue")).count();
    assert_eq!(queues, stated, "ladder plan declares {queues} queues:\n{plan}");
}

/// Every message the troubleshooting chapter quotes (a bold code span; `<…>` a placeholder, `…`
/// a cut) is one the code has.
#[test]
fn troubleshooting_quotes_messages_the_code_has() {
    fn sources(dir: &Path, out: &mut String) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                sources(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs") {
                // a string continued over lines (`\` then the indentation) reads as one
                let text = read(&path);
                let mut joined = String::new();
                let mut lines = text.lines();
                while let Some(line) = lines.next() {
                    joined.push_str(line.strip_suffix('\\').unwrap_or(line));
                    if !line.ends_with('\\') {
                        joined.push('\n');
                    } else if let Some(next) = lines.next() {
                        joined.push_str(next.trim_start());
                        joined.push('\n');
                    }
                }
                out.push_str(&joined);
            }
        }
    }
    let mut code = String::new();
    sources(&root().join("src"), &mut code);
    let page = chapter("troubleshooting.md")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let mut quoted = 0;
    let mut missing = vec![];
    for quote in page.split("**`").skip(1) {
        let message = quote.split('`').next().unwrap();
        let mut parts = vec![];
        for piece in message.split('…') {
            let mut rest = piece;
            while let Some(open) = rest.find('<') {
                parts.push(&rest[..open]);
                rest = rest[open..].split_once('>').map_or("", |(_, after)| after);
            }
            parts.push(rest);
        }
        for part in parts.into_iter().map(str::trim).filter(|p| p.len() >= 8) {
            quoted += 1;
            if !code.contains(part) {
                missing.push(part.to_string());
            }
        }
    }
    assert!(quoted >= 15, "the quotes were found: {quoted}");
    assert!(missing.is_empty(), "quoted but not in src/: {missing:#?}");
}

/// Every file of the repository a comment or a document names in backticks exists (issue 47):
/// `src/…`, `tests/…`, `docs/…` and the other top-level folders, and `../shared/…`.
#[test]
fn every_path_named_in_backticks_exists() {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap().flatten() {
            let path = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if path.is_dir() && name != "target" && name != "node_modules" && !name.starts_with('.') {
                walk(&path, out);
            } else if path.extension().is_some_and(|e| e == "rs" || e == "md") {
                out.push(path);
            }
        }
    }
    let mut files = vec![];
    for dir in ["src", "amqp/src", "bench/src", "tests", "docs/src"] {
        walk(&root().join(dir), &mut files);
    }
    for file in [
        "README.md",
        "ARCHITECTURE.md",
        "BENCHMARKS.md",
        "SECURITY.md",
        "CHANGELOG.md",
    ] {
        if root().join(file).exists() {
            files.push(root().join(file));
        }
    }
    let named = regex::Regex::new(
        r"`((?:\.\./shared|src|tests|amqp|bench|docs|scripts|deploy|examples|fuzz|benchmarks|ladders)/[A-Za-z0-9_./-]*[A-Za-z0-9_])(?:[:#][^`]*)?`",
    )
    .unwrap();
    let (mut checked, mut missing) = (0, vec![]);
    for file in &files {
        let text = read(file);
        let rust = file.extension().is_some_and(|e| e == "rs");
        for (n, line) in text.lines().enumerate() {
            // in Rust, only comments: a string may name a path of a test's own making
            if rust && !line.trim_start().starts_with("//") {
                continue;
            }
            for found in named.captures_iter(line) {
                let path = &found[1];
                // the book as `mdbook build` makes it, not kept in the repository
                if path.starts_with("docs/book/") {
                    continue;
                }
                checked += 1;
                if !root().join(path).exists() {
                    let here = file.strip_prefix(root()).unwrap_or(file).display();
                    missing.push(format!("{here}:{}: `{path}`", n + 1));
                }
            }
        }
    }
    assert!(checked > 100, "found only {checked} paths named: the scan is broken");
    assert!(
        missing.is_empty(),
        "paths named that do not exist:\n{}",
        missing.join("\n")
    );
}
