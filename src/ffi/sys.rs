//! `include/session_gate.h` as bindgen reads it (generated into `OUT_DIR` by build.rs): the C
//! types and constants the exports in this folder are written against, and the header's
//! function declarations that [`abi_check`](super::abi_check) holds the exports to.
//!
//! Rust callers use the types from here and the functions from [`ffi`](super).
#![allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    missing_docs,
    unreachable_pub,
    dead_code,
    clippy::all
)]

include!(concat!(env!("OUT_DIR"), "/session_gate_h.rs"));
