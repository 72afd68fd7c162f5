//! No source file of the workspace has more than [`MAX_LINES_OF_CODE`] lines of code (issue
//! 36): a file that grows past it is split by concern, as `model/protocol/` and
//! `config/tests.rs` were.

use std::path::{Path, PathBuf};

/// Lines of code a `.rs` file may have at most: lines that are neither blank nor comments.
const MAX_LINES_OF_CODE: usize = 1500;

/// Lines that are neither blank nor a `//` comment (doc comments included).
fn lines_of_code(text: &str) -> usize {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with("//"))
        .count()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let path = entry.path();
        let name = entry.file_name();
        if path.is_dir() {
            if name != "target" && !name.to_string_lossy().starts_with('.') {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

#[test]
fn no_source_file_has_more_than_1500_lines_of_code() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    for dir in ["src", "amqp", "bench", "tests", "fuzz", "examples"] {
        rust_files(&root.join(dir), &mut files);
    }
    assert!(files.len() > 50, "found only {} files: the walk is broken", files.len());
    let over: Vec<String> = files
        .iter()
        .filter_map(|f| {
            let n = lines_of_code(&std::fs::read_to_string(f).unwrap());
            (n > MAX_LINES_OF_CODE).then(|| format!("{} ({n})", f.strip_prefix(root).unwrap().display()))
        })
        .collect();
    assert!(
        over.is_empty(),
        "files over {MAX_LINES_OF_CODE} lines of code: {over:?}"
    );
}

#[test]
fn the_count_skips_blank_lines_and_comments() {
    assert_eq!(
        lines_of_code("//! doc\n\nfn a() {}\n    // why\n    let x = 1; // trailing\n"),
        2
    );
}
