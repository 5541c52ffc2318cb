//! Compile-time proof that the crate's C exports agree with `include/session_gate.h`.
//!
//! Types and constants cannot drift: the exports use the structs and values bindgen generated
//! from the header ([`sys`](super::sys)). Functions are checked by the generated
//! `exports_match_header`, which places each header declaration and the export of the same name
//! in one array (they must have identical signatures to share a type); build.rs also refuses an
//! export the header does not declare. What is left are facts bindgen cannot see, asserted below.
use super::sys;
use crate::const_eq::bytes_eq;
use crate::ffi as exports;
use crate::gate::{ProbeKind, Reason};

include!(concat!(env!("OUT_DIR"), "/session_gate_abi_check.rs"));

const fn parse_u32(s: &str) -> u32 {
    let b = s.as_bytes();
    let mut v = 0;
    let mut i = 0;
    while i < b.len() {
        v = v * 10 + (b[i] - b'0') as u32;
        i += 1;
    }
    v
}

// The header's version is the crate's: bump both together.
const _: () = {
    let header = sys::SG_VERSION;
    // The generated constant includes the C string's NUL.
    let (text, nul) = header.split_at(header.len() - 1);
    assert!(nul[0] == 0);
    assert!(bytes_eq(text, env!("CARGO_PKG_VERSION").as_bytes()));
    assert!(sys::SG_VERSION_MAJOR == parse_u32(env!("CARGO_PKG_VERSION_MAJOR")));
    assert!(sys::SG_VERSION_MINOR == parse_u32(env!("CARGO_PKG_VERSION_MINOR")));
    assert!(sys::SG_VERSION_PATCH == parse_u32(env!("CARGO_PKG_VERSION_PATCH")));
};

// The header's enumerations are as long as the gate's (stats arrays are sized by them).
const _: () = {
    assert!(sys::SG_REASON_COUNT == Reason::ALL.len());
    assert!(sys::SG_PROBE_KIND_COUNT == ProbeKind::ALL.len());
};
