//! Every log line about one connection carries its id, the number `vnatctl
//! ls` shows (`VirtualFlow::id()`), as a field named `id`: that is how a
//! line of `journalctl -u vnatd` is matched with a row of `vnatctl ls`
//! (`journalctl VNAT_ID=…`). This reads the sources of vnatd and of the
//! VCMP core and fails on a tracing event or span that logs a `flow`
//! field without an `id` field beside it.

use std::path::{Path, PathBuf};

const MACROS: [&str; 10] = [
    "tracing::trace!(",
    "tracing::debug!(",
    "tracing::info!(",
    "tracing::warn!(",
    "tracing::error!(",
    "tracing::trace_span!(",
    "tracing::debug_span!(",
    "tracing::info_span!(",
    "tracing::warn_span!(",
    "tracing::error_span!(",
];

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for entry in entries {
        let path = entry.expect("a directory entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|x| x == "rs") {
            out.push(path);
        }
    }
}

/// The arguments of the macro call whose `(` is at `open`, split at the
/// commas outside brackets and strings.
fn arguments(text: &str, open: usize) -> Vec<String> {
    let mut args = vec![String::new()];
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for c in text[open + 1..].chars() {
        if in_string {
            args.last_mut().expect("one argument").push(c);
            match c {
                _ if escaped => escaped = false,
                '\\' => escaped = true,
                '"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match c {
            '"' => in_string = true,
            '(' | '[' | '{' => depth += 1,
            ')' | ']' | '}' if depth == 0 => break,
            ')' | ']' | '}' => depth -= 1,
            ',' if depth == 0 => {
                args.push(String::new());
                continue;
            }
            _ => {}
        }
        args.last_mut().expect("one argument").push(c);
    }
    args
}

/// The field an argument names: `name = value`, `%name`, `?name` or
/// `name` (None for the message and the format arguments).
fn field_name(arg: &str) -> Option<&str> {
    let arg = arg.trim();
    if arg.starts_with('"') {
        return None;
    }
    let name = match arg.split_once('=') {
        Some((name, _)) if !name.contains(['(', '"']) => name.trim(),
        _ => arg.trim_start_matches(['%', '?']),
    };
    name.chars()
        .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
        .then_some(name)
}

#[test]
fn every_tracing_call_that_logs_a_flow_logs_its_id() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    rust_files(&root.join("vnat-daemon/src"), &mut files);
    rust_files(&root.join("vnat-vcmp/src"), &mut files);
    let mut calls = 0;
    let mut missing = Vec::new();
    for file in &files {
        let text = std::fs::read_to_string(file).expect("a readable source file");
        for mac in MACROS {
            for (at, _) in text.match_indices(mac) {
                let fields: Vec<String> = arguments(&text, at + mac.len() - 1)
                    .iter()
                    .filter_map(|a| field_name(a).map(str::to_string))
                    .collect();
                if !fields.iter().any(|f| f == "flow") {
                    continue;
                }
                calls += 1;
                if !fields.iter().any(|f| f == "id") {
                    let line = text[..at].matches('\n').count() + 1;
                    missing.push(format!("{}:{line}", file.display()));
                }
            }
        }
    }
    assert!(
        missing.is_empty(),
        "log a flow's id too (`id = flow.id(), flow = %flow`): {missing:#?}"
    );
    // The scan found what it is there for.
    assert!(calls > 50, "only {calls} tracing calls log a flow");
}

#[test]
fn the_scan_tells_fields_from_the_message() {
    let text = r#"tracing::warn!(id = f.id(), %flow, error = %e, "a, b = {c}", c = g(1, 2))"#;
    let names: Vec<Option<String>> = arguments(text, text.find('(').unwrap())
        .iter()
        .map(|a| field_name(a).map(str::to_string))
        .collect();
    assert_eq!(
        names,
        [Some("id"), Some("flow"), Some("error"), None, Some("c")].map(|n| n.map(str::to_string))
    );
    let text = r#"tracing::debug!(flow = ?t.flow, "x")"#;
    let args = arguments(text, text.find('(').unwrap());
    assert_eq!(field_name(&args[0]), Some("flow"));
}
