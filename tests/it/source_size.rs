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

/// Lines a function of src/ or amqp/ may span at most, signature to closing brace (issue 47).
const MAX_FUNCTION_LINES: usize = 100;

/// Every function and method outside test code, with the lines it spans.
struct Functions<'a> {
    file: &'a str,
    found: Vec<(String, usize)>,
}

fn is_test_code(attrs: &[syn::Attribute]) -> bool {
    attrs.iter().any(|a| {
        a.path().is_ident("test")
            || (a.path().is_ident("cfg") && a.meta.require_list().is_ok_and(|l| l.tokens.to_string() == "test"))
    })
}

impl Functions<'_> {
    fn record(&mut self, name: &syn::Ident, start: proc_macro2::Span, end: proc_macro2::Span) {
        let lines = end.end().line - start.start().line + 1;
        self.found
            .push((format!("{}:{} {name}", self.file, start.start().line), lines));
    }
}

impl<'ast> syn::visit::Visit<'ast> for Functions<'_> {
    fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
        if !is_test_code(&m.attrs) {
            syn::visit::visit_item_mod(self, m);
        }
    }
    fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
        if !is_test_code(&f.attrs) {
            use syn::spanned::Spanned;
            self.record(&f.sig.ident, f.sig.span(), f.block.brace_token.span.close());
            syn::visit::visit_item_fn(self, f);
        }
    }
    fn visit_impl_item_fn(&mut self, f: &'ast syn::ImplItemFn) {
        if !is_test_code(&f.attrs) {
            use syn::spanned::Spanned;
            self.record(&f.sig.ident, f.sig.span(), f.block.brace_token.span.close());
            syn::visit::visit_impl_item_fn(self, f);
        }
    }
}

/// Every function of the service and its AMQP client outside tests, with its length.
fn function_lengths() -> Vec<(String, usize)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = vec![];
    for dir in ["src", "amqp/src"] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut all = vec![];
    for f in files.iter().filter(|f| !f.ends_with("tests.rs")) {
        let text = std::fs::read_to_string(f).unwrap();
        let parsed = syn::parse_file(&text).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let name = f.strip_prefix(root).unwrap().display().to_string();
        let mut visitor = Functions {
            file: &name,
            found: vec![],
        };
        syn::visit::Visit::visit_file(&mut visitor, &parsed);
        all.extend(visitor.found);
    }
    all
}

#[test]
fn no_function_spans_more_than_100_lines() {
    let all = function_lengths();
    assert!(
        all.len() > 500,
        "found only {} functions: the walk is broken",
        all.len()
    );
    let mut over: Vec<_> = all.into_iter().filter(|(_, n)| *n > MAX_FUNCTION_LINES).collect();
    over.sort_by_key(|(_, n)| std::cmp::Reverse(*n));
    let list: Vec<String> = over.iter().map(|(f, n)| format!("{f} ({n})")).collect();
    assert!(
        over.is_empty(),
        "{} functions over {MAX_FUNCTION_LINES} lines:\n{}",
        over.len(),
        list.join("\n")
    );
}

#[test]
fn the_measure_counts_a_function_from_signature_to_brace_and_skips_tests() {
    let text = "fn a() {\n    let x = 1;\n}\n#[cfg(test)]\nmod tests {\n    fn b() {}\n}\nimpl S {\n    #[test]\n    fn c() {}\n    fn d(\n    ) {}\n}\n";
    let mut v = Functions {
        file: "f.rs",
        found: vec![],
    };
    syn::visit::Visit::visit_file(&mut v, &syn::parse_file(text).unwrap());
    assert_eq!(v.found, vec![("f.rs:1 a".to_string(), 3), ("f.rs:11 d".to_string(), 2)]);
}

/// A module of src/ (`broker::relay`, `model::lot::index`) and the modules its code outside
/// tests names through `crate::…` or `super::…`.
fn module_imports() -> std::collections::BTreeMap<String, std::collections::BTreeSet<String>> {
    struct Paths(Vec<Vec<String>>);
    impl<'ast> syn::visit::Visit<'ast> for Paths {
        fn visit_item_mod(&mut self, m: &'ast syn::ItemMod) {
            if !is_test_code(&m.attrs) {
                syn::visit::visit_item_mod(self, m);
            }
        }
        fn visit_item_fn(&mut self, f: &'ast syn::ItemFn) {
            if !is_test_code(&f.attrs) {
                syn::visit::visit_item_fn(self, f);
            }
        }
        fn visit_path(&mut self, p: &'ast syn::Path) {
            self.0.push(p.segments.iter().map(|s| s.ident.to_string()).collect());
            syn::visit::visit_path(self, p);
        }
        fn visit_use_tree(&mut self, tree: &'ast syn::UseTree) {
            fn walk(tree: &syn::UseTree, prefix: &mut Vec<String>, out: &mut Vec<Vec<String>>) {
                match tree {
                    syn::UseTree::Path(p) => {
                        prefix.push(p.ident.to_string());
                        walk(&p.tree, prefix, out);
                        prefix.pop();
                    }
                    syn::UseTree::Name(n) => out.push([prefix.clone(), vec![n.ident.to_string()]].concat()),
                    syn::UseTree::Rename(r) => out.push([prefix.clone(), vec![r.ident.to_string()]].concat()),
                    syn::UseTree::Glob(_) => out.push(prefix.clone()),
                    syn::UseTree::Group(g) => g.items.iter().for_each(|t| walk(t, prefix, out)),
                }
            }
            walk(tree, &mut Vec::new(), &mut self.0);
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = vec![];
    rust_files(&src, &mut files);
    let module_of = |f: &Path| -> String {
        let rel = f.strip_prefix(&src).unwrap().with_extension("");
        let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        let parts = match parts.last().map(String::as_str) {
            Some("mod") => &parts[..parts.len() - 1],
            _ => &parts[..],
        };
        parts.join("::")
    };
    let modules: std::collections::BTreeSet<String> = files.iter().map(|f| module_of(f)).collect();
    let mut imports = std::collections::BTreeMap::new();
    for f in files
        .iter()
        .filter(|f| !f.ends_with("tests.rs") && !f.ends_with("main.rs") && !f.ends_with("lib.rs"))
    {
        let module = module_of(f);
        let mut paths = Paths(vec![]);
        let parsed = syn::parse_file(&std::fs::read_to_string(f).unwrap()).unwrap();
        syn::visit::Visit::visit_file(&mut paths, &parsed);
        let parent: Vec<String> = module.split("::").map(str::to_string).collect();
        let mut named = std::collections::BTreeSet::new();
        for path in paths.0 {
            let absolute: Vec<String> = match path.first().map(String::as_str) {
                Some("crate") => path[1..].to_vec(),
                Some("super") => [&parent[..parent.len().saturating_sub(1)], &path[1..]].concat(),
                _ => continue,
            };
            // the longest prefix that is a module of its own, neither this one nor its parent or child
            if let Some(target) = (1..=absolute.len())
                .rev()
                .map(|n| absolute[..n].join("::"))
                .find(|m| modules.contains(m))
                && target != module
                && !module.starts_with(&format!("{target}::"))
                && !target.starts_with(&format!("{module}::"))
            {
                named.insert(target);
            }
        }
        imports.insert(module, named);
    }
    imports
}

/// The import circles among `imports`: every strongly connected set of more than one module.
fn circles(imports: &std::collections::BTreeMap<String, std::collections::BTreeSet<String>>) -> Vec<Vec<String>> {
    // a module is in a circle with another when each reaches the other
    let reach = |from: &String| -> std::collections::BTreeSet<String> {
        let mut seen = std::collections::BTreeSet::new();
        let mut next = vec![from.clone()];
        while let Some(m) = next.pop() {
            for n in imports.get(&m).into_iter().flatten() {
                if seen.insert(n.clone()) {
                    next.push(n.clone());
                }
            }
        }
        seen
    };
    let reaches: std::collections::BTreeMap<&String, _> = imports.keys().map(|m| (m, reach(m))).collect();
    let mut out: Vec<Vec<String>> = vec![];
    for m in imports.keys() {
        let circle: Vec<String> = imports
            .keys()
            .filter(|n| *n == m || (reaches[m].contains(*n) && reaches[*n].contains(m)))
            .cloned()
            .collect();
        if circle.len() > 1 && !out.contains(&circle) {
            out.push(circle);
        }
    }
    out
}

#[test]
fn no_module_of_src_imports_one_that_imports_it_back() {
    let imports = module_imports();
    assert!(
        imports.len() > 50,
        "found only {} modules: the walk is broken",
        imports.len()
    );
    assert!(
        imports.values().map(|i| i.len()).sum::<usize>() > 100,
        "found too few imports: the walk is broken"
    );
    let found = circles(&imports);
    assert!(found.is_empty(), "import circles: {found:?}");
}

#[test]
fn the_circle_check_finds_a_circle() {
    let set = |names: &[&str]| names.iter().map(|n| n.to_string()).collect();
    let imports = [
        ("a", set(&["b"])),
        ("b", set(&["c"])),
        ("c", set(&["a"])),
        ("d", set(&["a"])),
    ]
    .into_iter()
    .map(|(m, i)| (m.to_string(), i))
    .collect();
    assert_eq!(circles(&imports), vec![vec!["a".to_string(), "b".into(), "c".into()]]);
}
