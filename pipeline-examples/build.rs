//! Extracts the ```rust code blocks of the workspace's README.md and docs/*.md into
//! `$OUT_DIR/doc_blocks.rs`, which `tests/doc_blocks.rs` compiles and runs: a documented
//! Rust example that stops compiling or running fails `cargo test`.
//!
//! The markers are those of `scripts/check-docs` (which runs the Python and shell blocks and
//! documents the grammar): an HTML comment ending on the line before the fence,
//! `<!-- doc: gpu group=NAME wait-for=PATH timeout=SECONDS -->` or `<!-- doc: skip: REASON -->`.
//! Rust blocks hide lines as rustdoc does (`# ` prefix), and a block ending in
//! `Ok::<(), E>(())` runs as a function returning `Result<(), E>`, as in a doctest.

use std::fmt::Write as _;
use std::path::PathBuf;

/// One ```rust block and its marker.
struct Block {
    /// `README.md:115`: the document (relative to the workspace root) and the fence's line.
    place: String,
    /// The line of the block's first code line in its document.
    first_line: usize,
    code: String,
    gpu: bool,
    group: Option<String>,
    wait_for: Option<String>,
    timeout_s: Option<f64>,
    skip: bool,
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest
        .parent()
        .expect("pipeline-examples is in the workspace")
        .to_owned();
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets it")).join("doc_blocks.rs");
    let readme = root.join("README.md");
    let docs = root.join("docs");
    // Paths relative to this package, so that a copy of the workspace sharing a target
    // directory watches its own documents.
    println!("cargo:rerun-if-changed=../README.md");
    println!("cargo:rerun-if-changed=../docs");

    let generated = if readme.is_file() {
        let mut files = vec![readme];
        if let Ok(entries) = std::fs::read_dir(&docs) {
            let mut md: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.extension().is_some_and(|x| x == "md"))
                .collect();
            md.sort();
            files.extend(md);
        }
        let mut blocks = Vec::new();
        for file in &files {
            let rel = file.strip_prefix(&root).unwrap_or(file);
            println!("cargo:rerun-if-changed=../{}", rel.display());
            let text = std::fs::read_to_string(file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            blocks.extend(extract(&rel.display().to_string(), &text));
        }
        generate(&blocks)
    } else {
        // A packaged copy of this crate, without the workspace's documents: say so where the
        // tests would run, rather than pass with nothing checked.
        format!(
            "const DOCUMENTS_MISSING: Option<&str> = Some({:?});\nconst GROUPS: &[DocGroup] = &[];\n",
            readme.display().to_string()
        )
    };
    std::fs::write(&out, generated)
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
}

/// The ```rust blocks of one Markdown document, with their markers.
fn extract(file: &str, text: &str) -> Vec<Block> {
    let lines: Vec<&str> = text.lines().collect();
    let mut blocks = Vec::new();
    let mut i = 0;
    while i < lines.len() {
        let trimmed = lines[i].trim_start();
        let indent = lines[i].len() - trimmed.len();
        let fence_len = trimmed.chars().take_while(|&c| c == '`').count();
        if fence_len < 3 {
            i += 1;
            continue;
        }
        let info = trimmed[fence_len..].trim();
        let start = i;
        i += 1;
        let mut body = Vec::new();
        while i < lines.len() {
            let t = lines[i].trim();
            if t.len() >= fence_len && t.chars().all(|c| c == '`') {
                break;
            }
            body.push(lines[i].get(indent..).unwrap_or("").to_owned());
            i += 1;
        }
        i += 1;
        let lang = info.split([',', ' ']).next().unwrap_or("");
        if lang != "rust" {
            continue;
        }
        let place = format!("{file}:{}", start + 1);
        let mut block = Block {
            place: place.clone(),
            first_line: start + 2,
            code: body.join("\n"),
            gpu: false,
            group: None,
            wait_for: None,
            timeout_s: None,
            skip: false,
        };
        if start > 0 {
            let before = lines[start - 1].trim();
            if let Some(marker) = before
                .strip_prefix("<!--")
                .and_then(|m| m.trim_start().strip_prefix("doc:"))
            {
                let words = marker.trim_end().strip_suffix("-->").unwrap_or_else(|| {
                    panic!("{place}: a Rust block's doc marker is one line ending in -->")
                });
                read_marker(&mut block, words);
            }
        }
        blocks.push(block);
    }
    blocks
}

fn read_marker(block: &mut Block, words: &str) {
    let place = &block.place;
    let words = match words.split_once("skip:") {
        Some((before, _reason)) => {
            block.skip = true;
            before
        }
        None => words,
    };
    for word in words.split_whitespace() {
        match word.split_once('=') {
            None if word == "gpu" => block.gpu = true,
            Some(("group", v)) => block.group = Some(v.to_owned()),
            Some(("wait-for", v)) => block.wait_for = Some(v.to_owned()),
            Some(("timeout", v)) => {
                block.timeout_s = Some(
                    v.parse()
                        .unwrap_or_else(|_| panic!("{place}: timeout= takes seconds, not {v:?}")),
                )
            }
            _ => panic!(
                "{place}: a Rust block's doc marker takes gpu, group=, wait-for=, timeout= and \
                 skip: only, not {word:?} (see scripts/check-docs)"
            ),
        }
    }
}

/// The Rust source of a block's function, as rustdoc would wrap the block.
fn function(name: &str, block: &Block) -> String {
    let mut code = String::new();
    for line in block.code.lines() {
        let t = line.trim_start();
        // rustdoc's hidden lines: `# code` (or a lone `#`) is code not shown; `##` is a `#`.
        let shown = if t == "#" {
            ""
        } else if let Some(rest) = t.strip_prefix("# ") {
            rest
        } else if t.starts_with("##") {
            &t[1..]
        } else {
            line
        };
        if !shown.trim().is_empty() {
            code.push_str("        ");
            code.push_str(shown);
        }
        code.push('\n');
    }
    let mut f = String::new();
    let _ = writeln!(
        f,
        "// ---- the block at {}: its first line of code is line {} there",
        block.place, block.first_line
    );
    let _ = writeln!(f, "#[allow(unused, clippy::all)]\nfn {name}() {{");
    if code.trim_end().ends_with("(())") {
        f.push_str("    fn _inner() -> Result<(), impl core::fmt::Debug> {\n");
        f.push_str(&code);
        f.push_str("    }\n    _inner().unwrap()\n}\n");
    } else {
        f.push_str("    {\n");
        f.push_str(&code);
        f.push_str("    }\n}\n");
    }
    f
}

fn ident(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '_'
            }
        })
        .collect()
}

/// The runner's table: a function per block, and `GROUPS`, one group per group of blocks (or
/// lone block), in document order.
fn generate(blocks: &[Block]) -> String {
    let mut out = String::from(
        "// Generated by pipeline-examples/build.rs from README.md and docs/*.md.\n\n",
    );
    // Groups in document order: (file, group name) -> blocks.
    let mut groups: Vec<(String, Vec<&Block>)> = Vec::new();
    for b in blocks.iter().filter(|b| !b.skip) {
        let file = b.place.rsplit_once(':').map_or("", |(f, _)| f);
        let key = match &b.group {
            Some(g) => format!("{file}#{g}"),
            None => b.place.clone(),
        };
        match groups.iter_mut().find(|(k, _)| *k == key) {
            Some((_, members)) => members.push(b),
            None => groups.push((key, vec![b])),
        }
    }
    let mut table = String::from("const GROUPS: &[DocGroup] = &[\n");
    for (_, members) in &groups {
        let first = members[0];
        let group = ident(&match &first.group {
            Some(g) => format!("{}_{g}", first.place),
            None => first.place.clone(),
        });
        let timeout = members
            .iter()
            .filter_map(|b| b.timeout_s)
            .fold(60.0_f64, f64::max);
        let gpu = members.iter().any(|b| b.gpu);
        let _ = writeln!(
            table,
            "    DocGroup {{\n        name: {group:?},\n        gpu: {gpu},\n        timeout_s: {timeout:?},\n        blocks: &["
        );
        for (k, b) in members.iter().enumerate() {
            let name = format!("{group}_{k}");
            out.push_str(&function(&name, b));
            let _ = writeln!(
                table,
                "            DocBlock {{ place: {:?}, name: {name:?}, run: {name}, wait_for: {:?} }},",
                b.place, b.wait_for
            );
        }
        table.push_str("        ],\n    },\n");
    }
    table.push_str("];\n");
    out.push_str(&table);
    out.push_str("const DOCUMENTS_MISSING: Option<&str> = None;\n");
    out
}
