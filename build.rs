//! Build script: holds the C ABI to its committed header, and builds the C++ wrapper's test bridge.
//!
//! 1. bindgen reads `include/session_gate.h` and writes its types, constants and function
//!    declarations to `$OUT_DIR/session_gate_h.rs` (included by `src/ffi/sys.rs`). The exports in
//!    `src/ffi/` are written against those types, so a struct or constant can only mean what the
//!    header says.
//! 2. From the same output it writes `$OUT_DIR/session_gate_abi_check.rs` (included by
//!    `src/ffi/abi_check.rs`): one line per declared function that unifies the declaration with
//!    the crate's export of the same name. A missing export or a different signature is a type
//!    error, so header drift fails the build. The other direction — an export the header does not
//!    declare — is caught here by scanning `src/ffi/` for `no_mangle` items.
//! 3. cxx-build compiles the C++ side of the bridge in `tests/ffi_cxx.rs`, which lets `cargo test`
//!    drive the C++ wrapper (`include/session_gate.hpp`) and see its exceptions as Rust errors.
use std::collections::BTreeSet;
use std::env;
use std::fs;
use std::path::{Path, PathBuf};

use bindgen::callbacks::{IntKind, ParseCallbacks};

const HEADER: &str = "include/session_gate.h";
const FFI_DIR: &str = "src/ffi";

/// Gives each header macro the Rust type its C side means, so the generated constants can be
/// compared and used without casts (bindgen would make them all `u32`/`i32`).
#[derive(Debug)]
struct MacroTypes;

impl ParseCallbacks for MacroTypes {
    fn int_macro(&self, name: &str, _value: i64) -> Option<IntKind> {
        let custom = |name: &'static str, is_signed| Some(IntKind::Custom { name, is_signed });
        if name == "SG_WAIT_FOREVER" {
            Some(IntKind::I64)
        } else if name.starts_with("SG_VERSION_") {
            Some(IntKind::U32)
        } else if name == "SG_REASON_COUNT"
            || name.starts_with("SG_PROBE_")
            || name == "SG_MAX_TOKENS_DEFAULT"
        {
            // Array lengths and indices.
            custom("usize", false)
        } else if name.starts_with("SG_REASON_") {
            custom("sg_reason", true)
        } else if name.starts_with("SG_PRESSURE_") {
            custom("sg_pressure", true)
        } else if name.starts_with("SG_") {
            custom("sg_status", true)
        } else {
            None
        }
    }
}

fn main() {
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    println!("cargo:rerun-if-changed={HEADER}");
    println!("cargo:rerun-if-changed={FFI_DIR}");
    println!("cargo:rerun-if-changed=build.rs");

    let bindings = generate_bindings(&out_dir);
    let declared = declared_functions(&bindings);
    check_exports_are_declared(&declared);
    write_abi_check(&out_dir, &declared);
    build_cxx_bridge();
}

fn generate_bindings(out_dir: &Path) -> String {
    let bindings = bindgen::Builder::default()
        .header(HEADER)
        .allowlist_item("(sg|SG)_.*")
        // libc's C types, the same ones the exports spell out.
        .ctypes_prefix("::libc")
        .rust_target(bindgen::RustTarget::stable(88, 0).expect("a Rust version bindgen knows"))
        .rust_edition(bindgen::RustEdition::Edition2024)
        .derive_default(true)
        .parse_callbacks(Box::new(MacroTypes))
        .generate()
        .unwrap_or_else(|e| {
            panic!(
                "bindgen could not read {HEADER}: {e}\n\
                 bindgen needs libclang: `apt-get install libclang-dev` (or `make setup`)"
            )
        })
        .to_string();
    fs::write(out_dir.join("session_gate_h.rs"), &bindings).expect("write bindings");
    bindings
}

/// Names of the functions the header declares, read off bindgen's output (`pub fn name(`).
fn declared_functions(bindings: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = bindings;
    while let Some(at) = rest.find("pub fn ") {
        rest = &rest[at + "pub fn ".len()..];
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        names.insert(name);
    }
    assert!(
        names.contains("sg_gate_create"),
        "found no function declarations in {HEADER}"
    );
    names
}

/// Every `no_mangle` function under `src/ffi/` must be declared in the header.
fn check_exports_are_declared(declared: &BTreeSet<String>) {
    let mut exported = BTreeSet::new();
    for file in rust_files(Path::new(FFI_DIR)) {
        let text = fs::read_to_string(&file).expect("read src/ffi");
        let mut after_attr = false;
        for line in text.lines() {
            let line = line.trim_start();
            if line.starts_with("#[unsafe(no_mangle)]")
                || line.starts_with("#[no_mangle]")
                || line.starts_with("#[unsafe(export_name")
            {
                after_attr = true;
            } else if after_attr && let Some(at) = line.find("fn ") {
                let name: String = line[at + 3..]
                    .chars()
                    .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                    .collect();
                exported.insert(name);
                after_attr = false;
            }
        }
    }
    let undeclared: Vec<_> = exported.difference(declared).collect();
    assert!(
        undeclared.is_empty(),
        "src/ffi exports functions that {HEADER} does not declare: {undeclared:?}"
    );
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in fs::read_dir(dir).expect("read src/ffi").flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

fn write_abi_check(out_dir: &Path, declared: &BTreeSet<String>) {
    let mut code = String::from(
        "// Generated by build.rs from include/session_gate.h; do not edit.\n\
         \n\
         /// Every function the header declares, by name.\n\
         pub(crate) const HEADER_FUNCTIONS: &[&str] = &[\n",
    );
    for name in declared {
        code.push_str(&format!("    \"{name}\",\n"));
    }
    code.push_str(
        "];\n\
         \n\
         /// Never called: it exists to be type-checked. Each array holds the header's declaration\n\
         /// and the crate's export of one function; they unify only if their signatures are\n\
         /// identical, so a missing export or any drift in a parameter is a compile error.\n\
         #[allow(dead_code)]\n\
         fn exports_match_header() {\n",
    );
    for name in declared {
        code.push_str(&format!("    let _ = [sys::{name}, exports::{name}];\n"));
    }
    code.push_str("}\n");
    fs::write(out_dir.join("session_gate_abi_check.rs"), code).expect("write abi check");
}

fn build_cxx_bridge() {
    for path in [
        "tests/ffi_cxx.rs",
        "tests/c/cxx_harness.h",
        "tests/c/cxx_harness.cc",
        "include/session_gate.hpp",
    ] {
        println!("cargo:rerun-if-changed={path}");
    }
    cxx_build::bridge("tests/ffi_cxx.rs")
        .file("tests/c/cxx_harness.cc")
        .include("include")
        .include("tests/c")
        .std("c++17")
        .flag_if_supported("-Wall")
        .flag_if_supported("-Wextra")
        .compile("session_gate_cxx_harness");
}
