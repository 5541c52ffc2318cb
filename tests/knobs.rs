//! The knob table (`session_gate::gate::knobs::KNOBS`) against every surface it does not drive:
//! `GateConfig`'s fields and defaults, the C header's `sg_config`, `_native.pyi`, the proxy's
//! flags, and every `SESSION_GATE_*` variable the product source names.
use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use session_gate::gate::GateConfig;
use session_gate::gate::knobs::{self, Home, KNOBS, Knob, Rule, Value};

/// `SESSION_GATE_*` variables that are not knobs, and why.
const NOT_KNOBS: &[(&str, &str)] = &[
    (
        "SESSION_GATE_LOOP_SPLITS",
        "measurement switch: times the engine gate's loop (lab)",
    ),
    (
        "SESSION_GATE_BENCH_ENGINE",
        "benchmark fixture: which engine a bench starts (lab)",
    ),
    (
        "SESSION_GATE_VENV",
        "build: where `make setup` puts the virtual environment",
    ),
    (
        "SESSION_GATE_COMPAT_VLLM",
        "CI: the vLLM version `make test-compat` installs",
    ),
    (
        "SESSION_GATE_EXPECT_VLLM",
        "CI: the vLLM version the tests must see",
    ),
    (
        "SESSION_GATE_TEST_LOGS",
        "tests: where server logs are kept",
    ),
    (
        "SESSION_GATE_SERVE_TIMEOUT",
        "tests: how long a test server may take to start",
    ),
];

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

fn gate_rows() -> Vec<&'static Knob> {
    knobs::gate_knobs().collect()
}

/// The text between `start` and the next `end` after it.
fn between<'a>(text: &'a str, start: &str, end: &str) -> &'a str {
    let a = text
        .find(start)
        .unwrap_or_else(|| panic!("{start:?} not found"));
    let rest = &text[a + start.len()..];
    &rest[..rest
        .find(end)
        .unwrap_or_else(|| panic!("{end:?} not found after {start:?}"))]
}

#[test]
fn rows_are_unique_and_their_env_vars_are_their_names() {
    let names: BTreeSet<_> = KNOBS.iter().map(|k| k.name).collect();
    assert_eq!(names.len(), KNOBS.len(), "two rows share a name");
    for k in KNOBS {
        assert_eq!(k.name, k.name.to_ascii_lowercase(), "{}: lowercase", k.name);
        assert_eq!(
            k.env,
            format!("SESSION_GATE_{}", k.name.to_ascii_uppercase())
        );
        assert!(
            !k.doc.is_empty() && !k.doc.contains('\n'),
            "{}: one-line doc",
            k.name
        );
        assert_eq!(
            k.check(k.default),
            Ok(k.default),
            "{}: default breaks its rule",
            k.name
        );
    }
}

#[test]
fn gate_config_fields_are_the_gate_rows_in_order_with_their_defaults() {
    // Debug prints `GateConfig { a: .., b: .. }`: its field names, in declaration order.
    let debug = format!("{:?}", GateConfig::default());
    let fields: Vec<&str> = between(&debug, "{", "}")
        .split(", ")
        .map(|f| f.trim().split(':').next().unwrap())
        .collect();
    let rows: Vec<&str> = gate_rows().iter().map(|k| k.name).collect();
    assert_eq!(fields, rows);
    let defaults = GateConfig::default();
    for k in gate_rows() {
        assert_eq!(k.get(&defaults), Some(k.default), "{}", k.name);
    }
}

/// A value of `knob`'s kind other than its default, and its environment spelling.
fn other_value(knob: &Knob) -> (Value, String) {
    let v = match knob.rule {
        Rule::Fraction => Value::Number(0.25),
        Rule::Seconds | Rule::PositiveSeconds | Rule::SecondsOrOff => Value::Number(7.5),
        Rule::Count => Value::Count(12_345),
        Rule::OneOf { names, .. } => Value::Name(
            names
                .iter()
                .find(|n| Value::Name(n) != knob.default)
                .unwrap(),
        ),
    };
    (v, v.to_string())
}

#[test]
fn every_gate_row_is_set_from_its_env_var_and_read_back() {
    for k in gate_rows() {
        let (value, text) = other_value(k);
        let config = GateConfig::default()
            .with_env_overrides(|name| (name == k.env).then(|| format!(" {text} ")))
            .unwrap();
        assert_eq!(k.get(&config), Some(value), "{}", k.name);
        // Only this knob moved.
        for other in gate_rows().into_iter().filter(|o| o.name != k.name) {
            assert_eq!(other.get(&config), Some(other.default), "{}", other.name);
        }
        let mut direct = GateConfig::default();
        k.set(&mut direct, value).unwrap();
        assert_eq!(direct, config);
    }
}

#[test]
fn env_errors_name_the_knob_and_the_value_for_every_row() {
    for k in KNOBS {
        let bad = match k.rule {
            Rule::Fraction => "1.5",
            Rule::Seconds | Rule::PositiveSeconds | Rule::SecondsOrOff => "-2",
            Rule::Count => "2.5",
            Rule::OneOf { .. } => "sideways",
        };
        let err = k.lookup(|_| Some(bad.to_string())).unwrap_err().to_string();
        assert!(err.contains(k.name) && err.contains(bad), "{err}");
        let err = k.parse("lots").unwrap_err().to_string();
        assert!(err.contains(k.name) && err.contains("lots"), "{err}");
        assert_eq!(k.lookup(|_| Some("  ".into())), Ok(None), "blank is unset");
    }
}

#[test]
fn engine_rows_are_checked_by_the_table() {
    let ttl = knobs::knob("lease_ttl_sec").unwrap();
    assert!(matches!(ttl.home, Home::EngineCore));
    assert_eq!(ttl.parse("12"), Ok(Value::Number(12.0)));
    assert!(
        ttl.parse("0").is_err(),
        "a zero TTL would expire every client at once"
    );
    let cache = knobs::knob("chain_cache_bytes").unwrap();
    assert_eq!(cache.default, Value::Count(256 << 20));
    assert!(
        cache
            .set(&mut GateConfig::default(), cache.default)
            .is_err()
    );
}

#[test]
fn the_c_header_has_every_gate_knob_with_its_default_and_env_var() {
    let header = read("include/session_gate.h");
    let body = between(&header, "typedef struct sg_config {", "} sg_config;");
    // Each field is a `/** doc */` and its declaration, up to the `;`.
    let mut fields = Vec::new();
    for chunk in body.split("/**").skip(1) {
        let (doc, decl) = chunk.split_once("*/").unwrap();
        let name = decl.split(';').next().unwrap().split_whitespace().last();
        let doc = doc
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .to_lowercase();
        fields.push((name.unwrap().to_string(), doc));
    }
    let mut expected = Vec::new();
    for k in gate_rows() {
        if k.rule == Rule::SecondsOrOff {
            expected.push(format!("has_{}", k.name.trim_end_matches("_sec")));
        }
        expected.push(k.name.to_string());
    }
    let names: Vec<&str> = fields.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, expected);
    for k in gate_rows() {
        let doc = &fields.iter().find(|(n, _)| n == k.name).unwrap().1;
        let mention = format!("default {}", k.default);
        assert!(
            doc.contains(&mention),
            "sg_config.{}: doc lacks {mention:?}",
            k.name
        );
    }
    let from_env = between(
        &header,
        "sg_config sg_config_default(void);",
        "sg_config_from_env(",
    );
    for k in gate_rows() {
        assert!(
            from_env.contains(k.env),
            "sg_config_from_env's doc lacks {}",
            k.env
        );
    }
}

#[test]
fn the_python_stub_has_every_gate_knob_with_its_default_and_env_var() {
    let stub = read("python/session_gate/_native.pyi");
    let class = between(&stub, "class GateConfig:", "\n@final");
    let keywords: Vec<&str> = between(class, "*,", ") -> GateConfig")
        .lines()
        .filter_map(|l| l.trim().split(':').next())
        .filter(|n| !n.is_empty())
        .collect();
    let rows: Vec<&str> = gate_rows().iter().map(|k| k.name).collect();
    assert_eq!(keywords, rows, "GateConfig.__new__'s keywords");
    let docstring = between(class, "\"\"\"", "\"\"\"");
    let docstring = docstring.split_whitespace().collect::<Vec<_>>().join(" ");
    let from_env = between(class, "def from_env()", "@property");
    for k in gate_rows() {
        assert!(
            class.contains(&format!("    def {}(self)", k.name)),
            "property {}",
            k.name
        );
        let mention = format!("{} {}", k.name, k.default);
        assert!(docstring.contains(&mention), "docstring lacks {mention:?}");
        assert!(
            from_env.contains(k.env),
            "from_env's docstring lacks {}",
            k.env
        );
    }
    assert!(stub.contains("def knobs() -> list[_Knob]:"));
    assert!(stub.contains("def knob_from_env(name: str)"));
}

#[cfg(feature = "proxy")]
#[test]
fn the_proxy_has_a_flag_for_every_gate_knob_with_its_default() {
    use clap::CommandFactory;
    let command = session_gate::proxy::ProxyArgs::command();
    for k in gate_rows() {
        let flag = k.name.replace('_', "-");
        let arg = command
            .get_arguments()
            .find(|a| a.get_long() == Some(flag.as_str()))
            .unwrap_or_else(|| panic!("session-gate proxy has no --{flag}"));
        let help = arg.get_help().map(ToString::to_string).unwrap_or_default();
        let mention = format!("[default: {}]", k.default);
        assert!(
            help.contains(&mention),
            "--{flag}: help lacks {mention:?}: {help}"
        );
    }
}

/// Product source files: Rust under `src/`, Python under `python/session_gate/` minus `lab/`.
fn product_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            if path.is_dir() {
                if name != "lab" && name != "__pycache__" {
                    walk(&path, out);
                }
            } else if [".rs", ".py", ".pyi", ".toml"]
                .iter()
                .any(|ext| name.ends_with(ext))
            {
                out.push(path);
            }
        }
    }
    let mut files = Vec::new();
    walk(&root().join("src"), &mut files);
    walk(&root().join("python/session_gate"), &mut files);
    assert!(files.len() > 50, "found only {} source files", files.len());
    files
}

/// Every `SESSION_GATE_X` token in `text` (`SESSION_GATE_*` alone is not one).
fn env_tokens(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for (i, _) in text.match_indices("SESSION_GATE_") {
        let rest = &text[i + "SESSION_GATE_".len()..];
        let len = rest
            .find(|c: char| !(c.is_ascii_uppercase() || c.is_ascii_digit() || c == '_'))
            .unwrap_or(rest.len());
        let tail = rest[..len].trim_end_matches('_');
        if tail.starts_with(|c: char| c.is_ascii_uppercase()) {
            out.push(format!("SESSION_GATE_{tail}"));
        }
    }
    out
}

#[test]
fn every_session_gate_variable_of_the_product_is_a_row() {
    assert_eq!(
        env_tokens("`SESSION_GATE_*`, SESSION_GATE_A_B_, x"),
        ["SESSION_GATE_A_B"]
    );
    let table: BTreeSet<&str> = KNOBS.iter().map(|k| k.env).collect();
    let mut strays = BTreeSet::new();
    for path in product_files() {
        let text = std::fs::read_to_string(&path).unwrap();
        for token in env_tokens(&text) {
            if !table.contains(token.as_str()) && !NOT_KNOBS.iter().any(|(n, _)| *n == token) {
                strays.insert(format!("{}: {token}", path.display()));
            }
        }
        // A knob is read through the table, never by its variable's name.
        let rust_read = text.contains("env::var(\"SESSION_GATE_");
        let py_read = ["environ.get(\"SESSION_GATE_", "getenv(\"SESSION_GATE_"]
            .iter()
            .any(|p| text.contains(p));
        let py_read = py_read
            && table
                .iter()
                .any(|env| text.contains(&format!("(\"{env}\"")));
        assert!(
            !rust_read && !py_read,
            "{} reads a knob's variable itself",
            path.display()
        );
    }
    assert!(strays.is_empty(), "not rows of the knob table: {strays:?}");
}

#[test]
fn the_engine_half_reads_its_knobs_through_the_table() {
    let engine: String = product_files()
        .iter()
        .filter(|p| p.to_string_lossy().contains("session_gate/engine/"))
        .map(|p| std::fs::read_to_string(p).unwrap())
        .collect();
    for k in KNOBS.iter().filter(|k| matches!(k.home, Home::EngineCore)) {
        let call = format!("knob_from_env(\"{}\")", k.name);
        assert!(
            engine.contains(&call),
            "session_gate.engine never calls {call}"
        );
    }
}
