//! A progress bar for replays and discards, on stderr: drawn only when a person watches —
//! stdout and stderr both terminals and the output not `--json` — so it never ends up in a
//! pipe, a log or a script's JSON.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// The bar's look: what it does, how far, how long so far and still.
const TEMPLATE: &str = "{msg} [{bar:32}] {pos}/{len} entries, {elapsed} so far, {eta} left";

/// A progress bar that draws nothing unless [`Progress::new`] found a terminal, and nothing
/// before it knows how many entries there are (a prompt or a note may come first).
pub(crate) struct Progress {
    bar: ProgressBar,
    visible: bool,
    drawing: AtomicBool,
}

impl Progress {
    /// A bar for `what` (`replaying`, `discarding`), visible only on a terminal without `--json`.
    pub(crate) fn new(what: &'static str, json: bool) -> Self {
        Self::with(
            what,
            !json && std::io::stdout().is_terminal() && std::io::stderr().is_terminal(),
        )
    }

    fn with(what: &'static str, visible: bool) -> Self {
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::hidden());
        let style = ProgressStyle::with_template(TEMPLATE)
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> ");
        bar.set_style(style);
        bar.set_message(what);
        Progress {
            bar,
            visible,
            drawing: AtomicBool::new(false),
        }
    }

    /// Whether it draws once it knows the length (the API path asks for a short first wait then).
    pub(crate) fn is_shown(&self) -> bool {
        self.visible
    }

    /// The number of entries selected; the bar appears.
    pub(crate) fn set_length(&self, entries: usize) {
        self.bar.set_length(entries as u64);
        if self.visible && !self.drawing.swap(true, Ordering::Relaxed) {
            self.bar.reset();
            self.bar.set_draw_target(ProgressDrawTarget::stderr());
        }
    }

    /// One more entry done.
    pub(crate) fn inc(&self) {
        self.bar.inc(1);
    }

    /// `done` entries done.
    pub(crate) fn set_position(&self, done: usize) {
        self.bar.set_position(done as u64);
    }

    /// Erases the bar before the report is printed.
    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        // an error ends the command while the bar is drawn: leave the terminal clean for it
        if !self.bar.is_finished() {
            self.bar.finish_and_clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_template_parses_and_a_hidden_bar_counts_silently() {
        assert!(ProgressStyle::with_template(TEMPLATE).is_ok());
        let hidden = Progress::with("replaying", false);
        assert!(!hidden.is_shown());
        hidden.set_length(3);
        hidden.inc();
        hidden.set_position(2);
        hidden.finish();
    }
}
