//! `ladder completions <shell>` and `ladder man`: shell completions and manual pages generated
//! from the clap types, so they never disagree with the commands. Neither reads the config:
//! they run anywhere, before a `ladder.toml` exists (a shell's startup file, a package build).

use std::io::Write;
use std::path::Path;
use std::process::ExitCode;

use clap::CommandFactory;

use super::{Cli, Command};
use crate::exit;

/// The answer to `command` when it is one of these (they need no config), else `None`.
pub fn answer(command: &Command) -> Option<ExitCode> {
    match command {
        Command::Completions { shell } => Some(to_stdout(&completions(*shell))),
        Command::Man { dir: None } => Some(match page() {
            Ok(page) => to_stdout(&page),
            Err(e) => failed("stdout", &e),
        }),
        Command::Man { dir: Some(dir) } => Some(match pages(dir) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => failed(&dir.display().to_string(), &e),
        }),
        _ => None,
    }
}

/// The completion script for `shell`.
fn completions(shell: clap_complete::Shell) -> Vec<u8> {
    let mut script = Vec::new();
    clap_complete::generate(shell, &mut Cli::command(), "ladder", &mut script);
    script
}

/// `ladder(1)` in roff.
fn page() -> std::io::Result<Vec<u8>> {
    let mut page = Vec::new();
    clap_mangen::Man::new(Cli::command()).render(&mut page)?;
    Ok(page)
}

/// One page per command into `dir`: `ladder.1`, `ladder-parked.1`, `ladder-parked-replay.1`, …
fn pages(dir: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    clap_mangen::generate_to(Cli::command(), dir)
}

/// Writes `bytes` to stdout; a reader that stopped early (`| head`) is not an error.
fn to_stdout(bytes: &[u8]) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => failed("stdout", &e),
    }
}

fn failed(place: &str, e: &std::io::Error) -> ExitCode {
    eprintln!("ladder: cannot write to {place}: {e}");
    ExitCode::from(exit::FAILED)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clap_types_are_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn completions_know_every_command_and_option() {
        let bash = String::from_utf8(completions(clap_complete::Shell::Bash)).unwrap();
        for word in [
            "parked",
            "replay",
            "discard",
            "--body-contains",
            "--dry-run",
            "--admin",
            "--token",
            "man",
        ] {
            assert!(bash.contains(word), "bash completion lacks {word}");
        }
        let zsh = String::from_utf8(completions(clap_complete::Shell::Zsh)).unwrap();
        assert!(zsh.starts_with("#compdef ladder"), "{zsh}");
        assert!(String::from_utf8(page().unwrap()).unwrap().contains(".SH SUBCOMMANDS"));
    }

    #[test]
    fn a_page_per_command() {
        let dir = tempfile::tempdir().unwrap();
        pages(dir.path()).unwrap();
        for page in [
            "ladder.1",
            "ladder-parked.1",
            "ladder-parked-replay.1",
            "ladder-completions.1",
        ] {
            let text = std::fs::read_to_string(dir.path().join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
            assert!(text.contains(".TH"), "{page} is roff");
        }
        let replay = std::fs::read_to_string(dir.path().join("ladder-parked-replay.1")).unwrap();
        assert!(replay.contains("rate"), "options are documented: {replay}");
    }
}
