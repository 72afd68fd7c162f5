//! The commands the book shows: every `ladder …` command parses with the real binary, and every
//! other command holds the check [`CHECKS`] names for it (see the parent module's doc).

use super::*;

/// Splits a shell line into commands (at `|`, `;`, `&&`, `(`, `)`) of words, quotes removed,
/// up to a `#` comment.
fn shell_commands(line: &str) -> Vec<Vec<String>> {
    shell_pipeline(line).into_iter().map(|(words, _)| words).collect()
}

/// [`shell_commands`], each with whether it reads the output of the one before it (`a | b`).
fn shell_pipeline(line: &str) -> Vec<(Vec<String>, bool)> {
    let mut commands = vec![(vec![], false)];
    let mut word: Option<String> = None;
    let mut chars = line.chars().peekable();
    let mut quote: Option<char> = None;
    let end_word = |word: &mut Option<String>, commands: &mut Vec<(Vec<String>, bool)>| {
        if let Some(w) = word.take() {
            commands.last_mut().unwrap().0.push(w);
        }
    };
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.get_or_insert_with(String::new).push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                word.get_or_insert_with(String::new);
            }
            (None, '#') if word.is_none() => break,
            (None, c) if c.is_whitespace() => end_word(&mut word, &mut commands),
            (None, '|' | ';' | '&' | '(' | ')' | '<' | '>') => {
                end_word(&mut word, &mut commands);
                if c == '|' && chars.peek() != Some(&'|') {
                    commands.push((vec![], true));
                } else if matches!(c, '|' | ';' | '&' | '(' | ')') {
                    if matches!(c, '|' | '&') && chars.peek() == Some(&c) {
                        chars.next();
                    }
                    commands.push((vec![], false));
                } else {
                    // a redirection: its target is no argument
                    while chars.peek().is_some_and(|c| c.is_whitespace()) {
                        chars.next();
                    }
                    while chars.peek().is_some_and(|c| !c.is_whitespace() && *c != '(') {
                        chars.next();
                    }
                }
            }
            (None, c) => word.get_or_insert_with(String::new).push(c),
        }
    }
    end_word(&mut word, &mut commands);
    commands.retain(|(c, _)| !c.is_empty());
    commands
}

/// A command the book or README shows, in a shell block (a ```` ```sh ````, `bash`, `shell` or
/// `console` block, or a `$ ` line of a transcript) or in a code span of the prose.
#[derive(Debug)]
struct ShownCommand {
    /// The page and line, as `docs/src/<page>.md:12` (the line as mdBook renders it, includes
    /// expanded).
    place: String,
    /// The shell line it is part of.
    line: String,
    /// Its words, `VAR=value`, `source` and `exec` before it removed.
    words: Vec<String>,
    /// It reads the output of the command before it (`a | b`).
    piped: bool,
    /// In a code block rather than a code span of the prose.
    in_block: bool,
}

impl ShownCommand {
    fn name(&self) -> &str {
        &self.words[0]
    }
}

/// The commands of a shell line at `place`.
fn commands_of(place: &str, line: &str, in_block: bool) -> Vec<ShownCommand> {
    let mut out = vec![];
    for (mut words, piped) in shell_pipeline(line) {
        while words.first().is_some_and(|w| w.contains('=') && !w.starts_with('-')) {
            words.remove(0); // VAR=value
        }
        if words.first().is_some_and(|w| w == "source" || w == "exec") {
            words.remove(0);
        }
        if !words.is_empty() {
            out.push(ShownCommand {
                place: place.to_string(),
                line: line.trim().to_string(),
                words,
                piped,
                in_block,
            });
        }
    }
    out
}

/// Every command of the shell blocks of the book and README, and every code span of their prose
/// that starts with the name of a command the tests check (other than `ladder`: the prose names
/// its subcommands with placeholders, `ladder parked replay <offset>`).
fn shown_commands() -> Vec<ShownCommand> {
    let mut out = vec![];
    let mut files = book_pages();
    files.push(root().join("README.md"));
    for file in files {
        let name = file.strip_prefix(root()).unwrap().display().to_string();
        let text = page(&file);
        let mut info: Option<String> = None;
        let mut continued: Option<(usize, String)> = None; // a line ending in `\`, and the next
        for (i, line) in text.lines().enumerate() {
            if let Some(fence) = line.trim_start().strip_prefix("```") {
                info = match info {
                    None => Some(fence.trim().to_string()),
                    Some(_) => None,
                };
                continue;
            }
            let Some(info) = &info else { continue };
            let (number, line) = match continued.take() {
                Some((number, head)) => (number, format!("{head} {}", line.trim())),
                None => (i + 1, line.to_string()),
            };
            if let Some(head) = line.strip_suffix('\\') {
                continued = Some((number, head.trim_end().to_string()));
                continue;
            }
            let typed = match line.strip_prefix("$ ") {
                Some(typed) => typed,
                None if matches!(info.as_str(), "sh" | "bash" | "shell") => &line,
                None => continue,
            };
            out.extend(commands_of(&format!("{name}:{number}"), typed, true));
        }
        assert!(info.is_none(), "{name}: an unclosed code block");
        // the prose with fenced lines blanked, so that a code span over two lines reads as one
        let mut lines = vec![""; text.lines().count()];
        for (number, line) in prose(&text) {
            lines[number - 1] = line;
        }
        let prose = lines.join("\n");
        let mut rest = prose.as_str();
        while let Some(open) = rest.find('`') {
            let run = rest[open..].chars().take_while(|&c| c == '`').count();
            let after = &rest[open + run..];
            let Some(close) = after.find(&"`".repeat(run)) else {
                break;
            };
            let span = after[..close].split_whitespace().collect::<Vec<_>>().join(" ");
            let number = prose.len() - rest.len() + open;
            let number = prose[..number].matches('\n').count() + 1;
            for command in commands_of(&format!("{name}:{number}"), &span, false) {
                // a lone name (`curl`) mentions the tool rather than showing a command
                if command.name() != "ladder" && command.words.len() > 1 && check_name(command.name()).is_some() {
                    out.push(command);
                }
            }
            rest = &after[close + run..];
        }
    }
    out
}

/// The `ladder` invocations in the shell blocks (and the `$ ` lines of transcripts) of the book
/// and README; `cargo run … -- ARGS` counts as `ladder ARGS`.
fn documented_commands() -> Vec<(String, Vec<String>)> {
    let mut ladder = vec![];
    for command in shown_commands().into_iter().filter(|c| c.in_block) {
        let words = &command.words;
        if command.name() == "ladder" {
            ladder.push((command.place, words[1..].to_vec()));
        } else if command.name() == "cargo" && words.get(1).is_some_and(|w| w == "run") {
            let args = words
                .iter()
                .position(|w| w == "--")
                .map_or(vec![], |i| words[i + 1..].to_vec());
            ladder.push((command.place, args));
        }
    }
    ladder
}

/// Every `ladder …` command the book and README show parses with the binary's own command
/// definitions (`--help` appended: clap checks the subcommands, flags and values before it
/// prints the help).
#[test]
fn every_documented_command_parses() {
    assert_eq!(
        shell_commands(r#"LADDER_TOKEN=x ladder parked replay --why "a b" 1 | less # note"#),
        vec![
            vec!["LADDER_TOKEN=x", "ladder", "parked", "replay", "--why", "a b", "1"],
            vec!["less"]
        ]
    );
    let commands = documented_commands();
    assert!(commands.len() >= 25, "the commands were found: {commands:?}");
    let mut failed = vec![];
    for (file, args) in &commands {
        let output = Command::new(env!("CARGO_BIN_EXE_ladder"))
            .args(args)
            .arg("--help")
            .output()
            .unwrap();
        if !output.status.success() {
            failed.push(format!(
                "{file}: ladder {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&output.stderr)
                    .lines()
                    .next()
                    .unwrap_or_default()
            ));
        }
    }
    assert!(failed.is_empty(), "commands that do not parse:\n{}", failed.join("\n"));
}

/// Every command the book and README show, other than `ladder …`, with its check (the first
/// word; `scripts/…` any script). A command whose name is not here fails
/// [`every_shown_command_is_checked`]: a new kind of command needs a check first.
const CHECKS: &[(&str, &str)] = &[
    ("ladder", "parses with the binary (every_documented_command_parses)"),
    ("scripts/…", "the script exists and is executable"),
    (
        "cargo",
        "`cargo SUB --help` succeeds; -p names a workspace package, --bin/--test/… its target",
    ),
    (
        "rabbitmqctl",
        "`rabbitmqctl help SUB` succeeds and names every --option; set_policy's pattern and JSON parse; list_* columns exist",
    ),
    ("rabbitmq-diagnostics", "as rabbitmqctl"),
    ("rabbitmq-plugins", "as rabbitmqctl"),
    ("rabbitmq-upgrade", "as rabbitmqctl"),
    ("rabbitmq-server", "only `-detached`, which scripts/broker runs"),
    (
        "curl",
        "a known flag set; the URL is admin.bind and a route of the OpenAPI description with that method, its query parameters and body fields, a token exactly where the route needs one",
    ),
    (
        "kubectl",
        "a known verb; -n the manifests' namespace; -f/-k paths checked by scripts/check-deploy; kind/name a manifest; a port of that Service",
    ),
    (
        "podman",
        "a known verb; files named exist and are checked by scripts/check-deploy; images are scripts/image's",
    ),
    ("docker", "as podman"),
    ("podman-compose", "a known verb; -f a file scripts/check-deploy checks"),
    (
        "systemctl",
        "a known verb; each unit is deploy/UNIT.service, checked by scripts/check-deploy",
    ),
    ("systemd-analyze", "`verify`, which scripts/check-deploy runs"),
    (
        "promtool",
        "`check rules` or `test rules`, which scripts/check-deploy runs",
    ),
    ("mdbook", "a known verb on a directory with a book.toml"),
    ("npm", "the paths named exist"),
    ("node", "the paths named exist"),
    ("python", "the paths named exist"),
    ("python3", "the paths named exist"),
    ("go", "the paths named exist"),
    ("java", "the paths named exist"),
    ("ruby", "the paths named exist"),
    (
        "celery",
        "--workdir a directory with the module -A names; `call MODULE.TASK` a task that module defines",
    ),
    ("mvn", "the paths named exist"),
    ("grep", "reads the output of the command before it"),
    ("head", "reads the output of the command before it"),
    ("less", "reads the output of the command before it"),
    ("man", "`man -l -` reading the output of the command before it"),
    ("…", "a part of the line left out"),
];

/// `celery --workdir DIR -A MODULE …`: the module is a file in DIR, and a task it calls
/// (`call MODULE.TASK`) is defined there.
fn check_celery(args: &[String], wrong: &mut Vec<String>) {
    let value = |flag: &str| args.iter().position(|a| a == flag).and_then(|i| args.get(i + 1));
    let dir = root().join(value("--workdir").map_or(".", String::as_str));
    let Some(app) = value("-A") else {
        return wrong.push("no -A: the app module".into());
    };
    let Ok(source) = std::fs::read_to_string(dir.join(format!("{app}.py"))) else {
        return wrong.push(format!("-A {app}: no {app}.py in {}", dir.display()));
    };
    if let Some(task) = value("call") {
        let defined = task
            .split_once('.')
            .is_some_and(|(module, name)| module == app && source.contains(&format!("def {name}(")));
        if !defined {
            wrong.push(format!("{task}: not a task of {app}.py"));
        }
    }
}

/// The [`CHECKS`] entry for a command name.
fn check_name(name: &str) -> Option<&'static str> {
    let key = if name.starts_with("scripts/") {
        "scripts/…"
    } else {
        name
    };
    CHECKS.iter().find(|(c, _)| *c == key).map(|(c, _)| *c)
}

/// What the checks compare the commands with, read once.
struct Checker {
    /// `(METHOD, path template, operation)` of the OpenAPI description.
    routes: Vec<(String, String, serde_json::Value)>,
    description: serde_json::Value,
    /// The shipped config's admin.bind and ladders.
    bind: String,
    ladders: Vec<String>,
    /// `cargo metadata` of the workspace: package name → `(kind, name)` of its targets.
    packages: BTreeMap<String, Vec<(String, String)>>,
    check_deploy: String,
    /// `(kind, name)` of the Kubernetes manifests, the namespace, the Service's ports.
    manifests: Vec<(String, String)>,
    namespace: String,
    service_ports: Vec<String>,
    /// The exchanges and queues `ladder plan` declares for the shipped config.
    exchanges: Vec<String>,
    queues: Vec<String>,
    /// The help of a `rabbitmqctl`-like sub-command, asked once.
    help: BTreeMap<(String, String), Result<String, String>>,
}

impl Checker {
    fn new() -> Checker {
        let description = ladder::admin::openapi::description(&[]);
        let mut routes = vec![];
        for (path, item) in description["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                routes.push((method.to_uppercase(), path.clone(), operation.clone()));
            }
        }
        let config = ladder::config::load(&root().join("ladder.toml"), &Default::default()).unwrap();
        let metadata = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([
                "metadata",
                "--no-deps",
                "--offline",
                "--format-version",
                "1",
                "--manifest-path",
            ])
            .arg(root().join("Cargo.toml"))
            .output()
            .unwrap();
        assert!(
            metadata.status.success(),
            "{}",
            String::from_utf8_lossy(&metadata.stderr)
        );
        let metadata: serde_json::Value = serde_json::from_slice(&metadata.stdout).unwrap();
        let mut packages = BTreeMap::new();
        for package in metadata["packages"].as_array().unwrap() {
            let targets = package["targets"]
                .as_array()
                .unwrap()
                .iter()
                .flat_map(|t| {
                    let name = t["name"].as_str().unwrap().to_string();
                    t["kind"]
                        .as_array()
                        .unwrap()
                        .iter()
                        .map(move |k| (k.as_str().unwrap().to_string(), name.clone()))
                })
                .collect();
            packages.insert(package["name"].as_str().unwrap().to_string(), targets);
        }
        let (mut manifests, mut namespace, mut service_ports) = (vec![], String::new(), vec![]);
        for entry in std::fs::read_dir(root().join("deploy/kubernetes")).unwrap() {
            let path = entry.unwrap().path();
            let doc: serde_json::Value = serde_norway::from_str(&read(&path)).unwrap();
            let kind = doc["kind"].as_str().unwrap_or_default().to_string();
            if kind == "Kustomization" {
                namespace = doc["namespace"].as_str().unwrap().to_string();
            }
            if kind == "Service" {
                for port in doc["spec"]["ports"].as_array().unwrap() {
                    service_ports.push(port["port"].to_string());
                }
            }
            manifests.push((kind, doc["metadata"]["name"].as_str().unwrap_or_default().to_string()));
        }
        assert!(!namespace.is_empty() && !service_ports.is_empty(), "{manifests:?}");
        let plan = Command::new(env!("CARGO_BIN_EXE_ladder"))
            .args(["plan", "--config"])
            .arg(root().join("ladder.toml"))
            .output()
            .unwrap();
        assert!(plan.status.success(), "{}", String::from_utf8_lossy(&plan.stderr));
        let (mut exchanges, mut queues) = (vec![], vec![]);
        for line in String::from_utf8(plan.stdout).unwrap().lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next()) {
                (Some("exchange"), Some(name)) => exchanges.push(name.to_string()),
                (Some("queue"), Some(name)) => queues.push(name.to_string()),
                _ => {}
            }
        }
        Checker {
            routes,
            description,
            bind: config.admin.bind.to_string(),
            ladders: config.ladders.iter().map(|l| l.name.clone()).collect(),
            packages,
            check_deploy: read(&root().join("scripts/check-deploy")),
            manifests,
            namespace,
            service_ports,
            exchanges,
            queues,
            help: BTreeMap::new(),
        }
    }

    /// What is wrong with `command`; nothing when it holds.
    fn check(&mut self, command: &ShownCommand) -> Vec<String> {
        let words = &command.words;
        let args = &words[1..];
        let elided = words.iter().any(|w| w.contains('…'));
        let mut wrong = vec![];
        match check_name(command.name()) {
            Some("ladder" | "…") => {}
            Some("scripts/…") => {
                use std::os::unix::fs::PermissionsExt as _;
                match std::fs::metadata(root().join(command.name())) {
                    Ok(m) if m.is_file() && m.permissions().mode() & 0o111 != 0 => {}
                    Ok(_) => wrong.push(format!("{} is not an executable file", command.name())),
                    Err(_) => wrong.push(format!("{} does not exist", command.name())),
                }
            }
            Some("cargo") => self.check_cargo(args, &mut wrong),
            Some(tool @ ("rabbitmqctl" | "rabbitmq-diagnostics" | "rabbitmq-plugins" | "rabbitmq-upgrade")) => {
                // the prose names a sub-command alone (`rabbitmqctl set_policy`) without its arguments
                let mention = !command.in_block && args.len() == 1;
                self.check_rabbitmq(tool, args, elided || mention, &mut wrong)
            }
            Some("rabbitmq-server") => {
                if args != ["-detached"] || !read(&root().join("scripts/broker")).contains("rabbitmq-server -detached")
                {
                    wrong.push("not the `rabbitmq-server -detached` scripts/broker runs".into());
                }
            }
            Some("curl") => self.check_curl(args, &mut wrong),
            Some("kubectl") => self.check_kubectl(args, &mut wrong),
            Some("podman" | "docker") if args.first().is_some_and(|a| a == "compose") => {
                self.check_compose(&args[1..], &mut wrong)
            }
            Some("podman-compose") => self.check_compose(args, &mut wrong),
            Some("podman" | "docker") => {
                const VERBS: &[&str] = &["build", "save", "push", "load", "run", "image", "tag"];
                if !args.first().is_some_and(|v| VERBS.contains(&v.as_str())) {
                    wrong.push(format!("not a verb of {VERBS:?}"));
                }
                for arg in args {
                    if arg.contains("ladder:") && !arg.starts_with("localhost/ladder:") && !arg.contains("example.com")
                    {
                        wrong.push(format!("{arg}: not the image scripts/image builds (localhost/ladder)"));
                    }
                }
                self.check_deploy_files(args, &mut wrong);
            }
            Some("systemctl") => {
                const VERBS: &[&str] = &[
                    "status",
                    "start",
                    "stop",
                    "restart",
                    "reload",
                    "enable",
                    "disable",
                    "daemon-reload",
                ];
                let verb = args.first().map_or("", String::as_str);
                if !VERBS.contains(&verb) {
                    wrong.push(format!("{verb}: not a verb of {VERBS:?}"));
                }
                for unit in args.iter().skip(1).filter(|a| !a.starts_with('-')) {
                    let file = format!("deploy/{}.service", unit.trim_end_matches(".service"));
                    if !root().join(&file).is_file() || !self.check_deploy.contains(&file) {
                        wrong.push(format!("{unit}: no {file} that scripts/check-deploy checks"));
                    }
                }
            }
            Some("systemd-analyze") => {
                if args.first().is_none_or(|v| v != "verify") || !self.check_deploy.contains("systemd-analyze verify") {
                    wrong.push("only `systemd-analyze verify`, as scripts/check-deploy runs it".into());
                }
                self.check_deploy_files(&args[1..], &mut wrong);
            }
            Some("promtool") => {
                let verb = args.iter().take(2).cloned().collect::<Vec<_>>().join(" ");
                if !["check rules", "test rules"].contains(&verb.as_str())
                    || !self.check_deploy.contains(&format!("promtool {verb}"))
                {
                    wrong.push(format!("promtool {verb}: not what scripts/check-deploy runs"));
                }
                self.check_deploy_files(&args[2..], &mut wrong);
            }
            Some("mdbook") => {
                const VERBS: &[&str] = &["build", "serve", "test", "clean", "watch"];
                let verb = args.first().map_or("", String::as_str);
                let dir = args.get(1).map_or(".", String::as_str);
                if !VERBS.contains(&verb) || !root().join(dir).join("book.toml").is_file() {
                    wrong.push(format!(
                        "mdbook {verb} {dir}: not a verb of {VERBS:?} on a directory with a book.toml"
                    ));
                }
            }
            Some("celery") => check_celery(args, &mut wrong),
            Some("npm" | "node" | "python" | "python3" | "go" | "java" | "mvn" | "ruby") => {
                for arg in args.iter().filter(|a| looks_like_path(a)) {
                    if !root().join(arg).exists() {
                        wrong.push(format!("{arg} does not exist"));
                    }
                }
            }
            Some("grep" | "head" | "less") => {
                if !command.piped {
                    wrong.push("a filter that reads no command's output".into());
                }
            }
            Some("man") => {
                if !command.piped || args != ["-l", "-"] {
                    wrong.push("only `… | man -l -`".into());
                }
            }
            Some(other) => panic!("CHECKS names {other} but nothing checks it"),
            None => wrong.push("no check for this command: add one to CHECKS in tests/it/docs.rs".into()),
        }
        wrong
    }

    fn check_cargo(&self, args: &[String], wrong: &mut Vec<String>) {
        let Some(sub) = args.first() else {
            return wrong.push("no sub-command".into());
        };
        let help = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
            .args([sub, "--help"])
            .output()
            .unwrap();
        if !help.status.success() {
            wrong.push(format!("cargo {sub}: {}", String::from_utf8_lossy(&help.stderr).trim()));
        }
        let ours = args.iter().position(|a| a == "--").unwrap_or(args.len());
        let value = |flag: &str| {
            args[..ours]
                .iter()
                .position(|a| a == flag)
                .and_then(|i| args.get(i + 1))
        };
        let package = value("-p").or(value("--package")).map_or("ladder", String::as_str);
        let Some(targets) = self.packages.get(package) else {
            return wrong.push(format!("-p {package}: no such package in the workspace"));
        };
        for (flag, kind) in [
            ("--bin", "bin"),
            ("--test", "test"),
            ("--example", "example"),
            ("--bench", "bench"),
        ] {
            if let Some(name) = value(flag)
                && !targets.iter().any(|(k, n)| k == kind && n == name)
            {
                wrong.push(format!("{flag} {name}: package {package} has no such target"));
            }
        }
    }

    fn check_rabbitmq(&mut self, tool: &str, args: &[String], elided: bool, wrong: &mut Vec<String>) {
        let Some(sub) = args.first().filter(|s| !s.starts_with('-') && *s != "…") else {
            return wrong.push("no sub-command".into());
        };
        let help = self
            .help
            .entry((tool.to_string(), sub.clone()))
            .or_insert_with(|| {
                let out = Command::new(tool)
                    .args(["help", sub])
                    .output()
                    .map_err(|e| format!("{tool} does not run here ({e}); the tests need RabbitMQ's CLI tools"))?;
                if out.status.success() {
                    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
                } else {
                    Err(format!(
                        "`{tool} help {sub}` fails: {}",
                        String::from_utf8_lossy(&out.stderr).trim()
                    ))
                }
            })
            .clone();
        let help = match help {
            Ok(help) => help,
            Err(e) => return wrong.push(e),
        };
        // the options that take a value, and the positional arguments
        let mut positional = vec![];
        let mut rest = args[1..].iter();
        while let Some(arg) = rest.next() {
            if let Some(option) = arg.strip_prefix("--") {
                let option = option.split('=').next().unwrap();
                if !help.contains(&format!("--{option} <"))
                    && !help.contains(&format!("--{option}]"))
                    && !help.contains(&format!("--{option}\n"))
                {
                    wrong.push(format!("{tool} {sub} takes no --{option}"));
                } else if help.contains(&format!("--{option} <")) && !arg.contains('=') {
                    let value = rest.next().map_or("", String::as_str);
                    if option == "apply-to" && !["queues", "exchanges", "all"].contains(&value) {
                        wrong.push(format!("--apply-to {value}: not queues, exchanges or all"));
                    }
                }
            } else {
                positional.push(arg.as_str());
            }
        }
        if elided {
            return;
        }
        if sub == "set_policy" {
            match positional.as_slice() {
                [_name, pattern, definition] => self.check_policy(pattern, definition, wrong),
                _ => wrong.push("set_policy takes <name> <pattern> <definition>".into()),
            }
        } else if let Some(columns) = help.split("must be one of ").nth(1) {
            let columns: Vec<&str> = columns.lines().next().unwrap().split(", ").collect();
            for column in positional {
                if !columns.contains(&column) {
                    wrong.push(format!("{tool} {sub} has no column {column}"));
                }
            }
        } else if !usage_arguments(&help, sub).contains(&positional.len()) {
            wrong.push(format!(
                "{tool} {sub} takes {:?} argument(s), not {positional:?}",
                usage_arguments(&help, sub)
            ));
        }
    }

    /// A policy's pattern compiles and, when it names Ladder's queues (`^ladder`), matches one of
    /// the shipped plan's; its definition is a JSON object of policy keys RabbitMQ knows, and a
    /// dead-letter exchange it names is one the plan declares.
    fn check_policy(&self, pattern: &str, definition: &str, wrong: &mut Vec<String>) {
        /// The policy keys of RabbitMQ 3.10 to 4.x for queues and exchanges.
        const KEYS: &[&str] = &[
            "alternate-exchange",
            "dead-letter-exchange",
            "dead-letter-routing-key",
            "dead-letter-strategy",
            "delivery-limit",
            "expires",
            "max-age",
            "max-length",
            "max-length-bytes",
            "message-ttl",
            "overflow",
            "queue-mode",
            "queue-version",
            "queue-leader-locator",
            "initial-cluster-size",
            "stream-max-segment-size-bytes",
            "federation-upstream",
            "federation-upstream-set",
        ];
        match regex::Regex::new(pattern) {
            Err(e) => wrong.push(format!("the pattern {pattern}: {e}")),
            Ok(regex) => {
                if pattern.starts_with("^ladder") && !self.queues.iter().any(|q| regex.is_match(q)) {
                    wrong.push(format!("the pattern {pattern} matches no queue of `ladder plan`"));
                }
            }
        }
        let Some(definition) = serde_json::from_str::<serde_json::Value>(definition)
            .ok()
            .filter(|d| d.is_object())
        else {
            return wrong.push(format!("the definition {definition} is no JSON object"));
        };
        for (key, value) in definition.as_object().unwrap() {
            if !KEYS.contains(&key.as_str()) {
                wrong.push(format!("the definition's {key}: not a policy key"));
            }
            if key == "dead-letter-exchange" && !value.as_str().is_some_and(|e| self.exchanges.iter().any(|x| x == e)) {
                wrong.push(format!(
                    "the dead-letter exchange {value} is not one `ladder plan` declares"
                ));
            }
        }
    }

    /// Resolves `{"$ref": "#/…"}` in the OpenAPI description.
    fn resolve<'a>(&'a self, value: &'a serde_json::Value) -> &'a serde_json::Value {
        match value["$ref"].as_str() {
            Some(reference) => self.description.pointer(reference.trim_start_matches('#')).unwrap(),
            None => value,
        }
    }

    fn check_curl(&self, args: &[String], wrong: &mut Vec<String>) {
        let (mut method, mut headers, mut body, mut urls) = (None, vec![], None, vec![]);
        let mut rest = args.iter();
        while let Some(arg) = rest.next() {
            match arg.as_str() {
                "-s" | "--silent" | "-S" | "--show-error" | "-f" | "--fail" | "-i" | "--include" | "-v" => {}
                "-X" | "--request" => method = rest.next().cloned(),
                "-H" | "--header" => headers.extend(rest.next().cloned()),
                "-d" | "--data" | "--data-raw" => body = rest.next().cloned(),
                "-o" | "--output" => {
                    rest.next();
                }
                flag if flag.starts_with('-') => wrong.push(format!("curl {flag}: not a flag the book uses")),
                url => urls.push(url),
            }
        }
        let [url] = urls.as_slice() else {
            return wrong.push(format!("not one URL: {urls:?}"));
        };
        let method = method.unwrap_or_else(|| if body.is_some() { "POST" } else { "GET" }.into());
        let Some(target) = url.strip_prefix(&format!("http://{}", self.bind)) else {
            return wrong.push(format!("{url}: not the shipped admin.bind {}", self.bind));
        };
        let (path, query) = target.split_once('?').unwrap_or((target, ""));
        let matches = |template: &str| {
            let (a, b): (Vec<_>, Vec<_>) = (template.split('/').collect(), path.split('/').collect());
            a.len() == b.len()
                && a.iter()
                    .zip(&b)
                    .all(|(t, p)| t == p || (t.starts_with('{') && !p.is_empty()))
        };
        let Some((_, template, operation)) = self.routes.iter().find(|(m, t, _)| *m == method && matches(t)) else {
            let methods: Vec<_> = self
                .routes
                .iter()
                .filter(|(_, t, _)| matches(t))
                .map(|(m, _, _)| m)
                .collect();
            return wrong.push(format!(
                "{method} {path}: no such route (methods for the path: {methods:?})"
            ));
        };
        let parameters: Vec<&serde_json::Value> = operation["parameters"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| self.resolve(p))
            .collect();
        for (t, p) in template.split('/').zip(path.split('/')) {
            if t == "{ladder}" && !self.ladders.iter().any(|l| l == p) {
                wrong.push(format!("{path}: no ladder {p} in the shipped config"));
            }
        }
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let name = pair.split('=').next().unwrap();
            if !parameters.iter().any(|p| p["in"] == "query" && p["name"] == name) {
                wrong.push(format!("{method} {template} takes no query parameter {name}"));
            }
        }
        let token = headers
            .iter()
            .any(|h| h.to_lowercase().starts_with("authorization: bearer "));
        let secured = operation.get("security").is_some();
        if token != secured {
            wrong.push(format!(
                "{method} {template}: a token {}",
                if secured { "is needed" } else { "is sent but not needed" }
            ));
        }
        if let Some(body) = body {
            let schema = &operation["requestBody"]["content"]["application/json"]["schema"];
            match serde_json::from_str::<serde_json::Value>(&body) {
                Err(e) => wrong.push(format!("the body {body}: {e}")),
                Ok(value) => {
                    let properties = &self.resolve(schema)["properties"];
                    for key in value.as_object().into_iter().flat_map(|o| o.keys()) {
                        if properties.get(key).is_none() {
                            wrong.push(format!("{method} {template} takes no body field {key}"));
                        }
                    }
                }
            }
            if !headers
                .iter()
                .any(|h| h.eq_ignore_ascii_case("content-type: application/json"))
            {
                wrong.push("a body without Content-Type: application/json".into());
            }
        }
    }

    fn check_kubectl(&self, args: &[String], wrong: &mut Vec<String>) {
        const VERBS: &[&str] = &["apply", "get", "describe", "rollout", "port-forward", "logs", "delete"];
        let mut positional = vec![];
        let mut rest = args.iter();
        while let Some(arg) = rest.next() {
            match arg.as_str() {
                "-n" | "--namespace" => {
                    if rest.next() != Some(&self.namespace) {
                        wrong.push(format!("not the manifests' namespace {}", self.namespace));
                    }
                }
                "-f" | "--filename" | "-k" | "--kustomize" => {
                    self.check_deploy_files(rest.next().cloned().as_slice(), wrong)
                }
                flag if flag.starts_with('-') => {}
                _ => positional.push(arg.as_str()),
            }
        }
        let verb = positional.first().copied().unwrap_or_default();
        if !VERBS.contains(&verb) {
            wrong.push(format!("kubectl {verb}: not a verb of {VERBS:?}"));
        }
        let kinds = [
            ("deployment", "Deployment"),
            ("deploy", "Deployment"),
            ("svc", "Service"),
            ("service", "Service"),
        ];
        for arg in positional.iter().filter(|a| a.contains('/')) {
            let (kind, name) = arg.split_once('/').unwrap();
            let kind = kinds.iter().find(|(k, _)| *k == kind).map_or(kind, |(_, k)| k);
            if !self.manifests.iter().any(|(k, n)| k == kind && n == name) {
                wrong.push(format!("{arg}: no {kind} {name} in deploy/kubernetes"));
            }
        }
        if verb == "port-forward" {
            for port in positional.iter().skip(2) {
                let remote = port.rsplit(':').next().unwrap();
                if !self.service_ports.iter().any(|p| p == remote) {
                    wrong.push(format!("{port}: not a port of the Service ({:?})", self.service_ports));
                }
            }
        }
    }

    fn check_compose(&self, args: &[String], wrong: &mut Vec<String>) {
        const VERBS: &[&str] = &["up", "down", "config", "ps", "logs"];
        let mut verb = None;
        let mut rest = args.iter();
        while let Some(arg) = rest.next() {
            match arg.as_str() {
                "-f" | "--file" => self.check_deploy_files(rest.next().cloned().as_slice(), wrong),
                flag if flag.starts_with('-') => {}
                other => {
                    verb.get_or_insert(other);
                }
            }
        }
        if !verb.is_some_and(|v| VERBS.contains(&v)) {
            wrong.push(format!("compose {verb:?}: not a verb of {VERBS:?}"));
        }
    }

    /// The repository files among `args` exist and scripts/check-deploy checks them.
    fn check_deploy_files(&self, args: &[String], wrong: &mut Vec<String>) {
        for arg in args.iter().filter(|a| looks_like_path(a) && !a.contains(':')) {
            let checked =
                self.check_deploy.contains(arg.as_str()) || self.check_deploy.contains(arg.trim_end_matches('/'));
            if !root().join(arg).exists() || !checked {
                wrong.push(format!(
                    "{arg}: not a file of the repository that scripts/check-deploy checks"
                ));
            }
        }
    }
}

/// How many positional arguments the usage line of `sub` in its help allows, one count per
/// alternative (`set_disk_free_limit <disk_limit> | mem_relative <fraction>`: 1 or 2): its words
/// and `<…>` placeholders outside the `[…]` of options.
fn usage_arguments(help: &str, sub: &str) -> Vec<usize> {
    let Some(line) = help.lines().find(|l| l.contains(&format!(" {sub}"))) else {
        return vec![0];
    };
    let after = &line[line.find(&format!(" {sub}")).unwrap() + sub.len() + 1..];
    let (mut square, mut angle) = (0usize, 0usize);
    let mut alternatives = vec![String::new()];
    for c in after.chars() {
        match c {
            '[' => square += 1,
            ']' => square = square.saturating_sub(1),
            '<' => angle += 1,
            '>' => angle = angle.saturating_sub(1),
            '|' if square == 0 && angle == 0 => alternatives.push(String::new()),
            _ if square == 0 => alternatives.last_mut().unwrap().push(if angle > 0 { 'x' } else { c }),
            _ => {}
        }
    }
    alternatives.iter().map(|a| a.split_whitespace().count()).collect()
}

/// A path of the repository rather than a name or a value: a `/` or a file extension.
fn looks_like_path(arg: &str) -> bool {
    !arg.starts_with('-')
        && !arg.contains("://")
        && (arg.contains('/')
            || [
                ".py", ".js", ".java", ".go", ".toml", ".yaml", ".yml", ".json", ".service",
            ]
            .iter()
            .any(|e| arg.ends_with(e))
            || arg.ends_with("Containerfile"))
}

/// Every command the book and README show that is not `ladder …` holds its check ([`CHECKS`]),
/// and a command no check knows fails.
#[test]
fn every_shown_command_is_checked() {
    let commands = shown_commands();
    let mut checker = Checker::new();
    let mut seen = BTreeSet::new();
    let mut failed = vec![];
    for command in &commands {
        seen.insert(check_name(command.name()).unwrap_or(command.name()));
        for problem in checker.check(command) {
            failed.push(format!("{}: {}: {problem}", command.place, command.line));
        }
    }
    assert!(failed.is_empty(), "commands that do not hold:\n{}", failed.join("\n"));
    for (name, count) in [
        ("rabbitmqctl", 5),
        ("curl", 3),
        ("kubectl", 4),
        ("systemctl", 3),
        ("cargo", 3),
    ] {
        let found = commands.iter().filter(|c| c.name() == name).count();
        assert!(found >= count, "{found} {name} commands were found: {commands:#?}");
    }
    eprintln!("{} commands checked: {seen:?}", commands.len());
}

/// The command checks themselves: a broken line of each kind fails, naming the line.
#[test]
fn the_command_checks_catch_what_is_broken() {
    assert_eq!(
        shell_pipeline("a | b || c && d"),
        vec![
            (vec!["a".into()], false),
            (vec!["b".into()], true),
            (vec!["c".into()], false),
            (vec!["d".into()], false)
        ]
    );
    let mut checker = Checker::new();
    let mut check = |line: &str| -> Vec<String> {
        commands_of("test:1", line, true)
            .iter()
            .flat_map(|c| checker.check(c))
            .collect()
    };
    for good in [
        "rabbitmqctl set_policy p '^a$' '{\"max-age\": \"1D\"}' --apply-to queues",
        "rabbitmqctl list_queues name messages | grep x",
        "rabbitmqctl enable_feature_flag all",
        "rabbitmq-upgrade drain",
        "rabbitmqctl set_disk_free_limit mem_relative 1.5",
        "rabbitmqctl set_vm_memory_high_watermark 0.6",
        "curl -s http://127.0.0.1:9464/api/ladders/default/parked?limit=2",
        "kubectl -n ladder port-forward svc/ladder 9464",
        "systemctl status ladder",
        "cargo run -p ladder-bench --bin ladder-bench",
    ] {
        assert_eq!(check(good), Vec::<String>::new(), "{good}");
    }
    for (bad, problem) in [
        ("rabbitmqctl set_polcy p x '{}'", "`rabbitmqctl help set_polcy` fails"),
        ("rabbitmq-upgrade drain now", "takes [0] argument(s)"),
        ("rabbitmqctl enable_feature_flag", "takes [1] argument(s)"),
        (
            "rabbitmqctl set_policy p '^a$' '{max-age: 1}' --apply-to queues",
            "no JSON object",
        ),
        (
            "rabbitmqctl set_policy p '^a$' '{}' --apply-too queues",
            "takes no --apply-too",
        ),
        ("rabbitmqctl list_queues name mesages", "no column mesages"),
        (
            "rabbitmqctl set_policy p '^ladder\\.x$' '{}' --apply-to queues",
            "matches no queue",
        ),
        (
            "rabbitmqctl set_policy p '^a$' '{\"max-ag\": \"1D\"}'",
            "not a policy key",
        ),
        (
            "rabbitmqctl set_policy p '^a$' '{\"dead-letter-exchange\": \"ladder\"}'",
            "not one `ladder plan` declares",
        ),
        (
            "rabbitmqctl set_policy p '^a$' '{}' --apply-to queue",
            "not queues, exchanges or all",
        ),
        ("curl -s http://127.0.0.1:9464/api/nowhere", "no such route"),
        (
            "curl -s -X POST http://127.0.0.1:9464/api/ladders/default/parked",
            "no such route",
        ),
        (
            "curl -s http://127.0.0.1:9464/api/ladders/default/parked?reasn=x",
            "no query parameter reasn",
        ),
        (
            "curl -s -d '{\"to\": 1}' -H 'Content-Type: application/json' http://127.0.0.1:9464/api/ladders/default/parked/replay",
            "a token is needed",
        ),
        (
            "curl -s -H 'Authorization: Bearer t' -H 'Content-Type: application/json' -d '{\"destinaton\": \"o\"}' \
             http://127.0.0.1:9464/api/ladders/default/parked/replay",
            "takes no body field destinaton",
        ),
        (
            "curl -s http://127.0.0.1:9464/api/ladders/nowhere/parked",
            "no ladder nowhere",
        ),
        ("curl -s http://127.0.0.1:8080/metrics", "not the shipped admin.bind"),
        (
            "kubectl apply -f deploy/kubernetes/nowhere.yaml",
            "not a file of the repository",
        ),
        ("kubectl -n default get pods", "not the manifests' namespace"),
        (
            "kubectl -n ladder rollout restart deployment/ladders",
            "no Deployment ladders",
        ),
        ("podman build -f deploy/Dockerfile .", "deploy/Dockerfile: not a file"),
        ("systemctl status ladder-relay", "no deploy/ladder-relay.service"),
        ("cargo run -p ladder --bin nowhere", "--bin nowhere"),
        ("cargo run -p nowhere", "no such package"),
        ("mdbook build book", "a directory with a book.toml"),
        ("python3 examples/python/nowhere.py", "does not exist"),
        ("ruby examples/ruby/nowhere.rb", "does not exist"),
        ("celery --workdir examples/celery -A nowhere worker", "no nowhere.py"),
        (
            "celery --workdir examples/celery -A tasks call tasks.nowhere",
            "not a task of tasks.py",
        ),
        ("grep x", "reads no command's output"),
        ("scripts/nowhere", "does not exist"),
        ("make docs", "no check for this command"),
    ] {
        let found = check(bad);
        assert!(
            found.iter().any(|p| p.contains(problem)),
            "{bad}: {found:?} (not {problem})"
        );
    }
}
