//! The C ABI's contract outside the gate's behaviour: the shared library exports every function
//! the header declares, codes have the header's names, NULL pointers give `SG_NULL_POINTER`
//! everywhere, and `sg_last_error` works as documented (per thread, sized by the caller).
use std::ffi::{CStr, CString};
use std::path::PathBuf;
use std::ptr;

use session_gate::ffi::sys::{self, sg_lease_info, sg_probe, sg_request, sg_stats};
use session_gate::ffi::*;

/// The cdylib `cargo test` built next to this test binary.
fn shared_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let dir = exe.parent().unwrap();
    let lib = dir.join(format!(
        "{}session_gate{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    ));
    assert!(lib.exists(), "no shared library at {}", lib.display());
    lib
}

#[test]
fn the_shared_library_exports_every_function_the_header_declares() {
    let path = CString::new(shared_library().to_str().unwrap()).unwrap();
    // SAFETY: loading our own library; RTLD_NOW also proves it has no undefined symbols.
    let lib = unsafe { libc::dlopen(path.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    assert!(!lib.is_null(), "dlopen failed");
    assert!(header_functions().len() >= 20);
    for name in header_functions() {
        let c = CString::new(*name).unwrap();
        // SAFETY: a handle from dlopen and a NUL-terminated name.
        let sym = unsafe { libc::dlsym(lib, c.as_ptr()) };
        assert!(!sym.is_null(), "{name} is not exported");
    }
    let version = CString::new("sg_version").unwrap();
    // SAFETY: `sg_version` has this signature (checked against the header at build time).
    let sg_version_in_lib: extern "C" fn() -> *const libc::c_char =
        unsafe { std::mem::transmute(libc::dlsym(lib, version.as_ptr())) };
    // SAFETY: a static NUL-terminated string.
    let v = unsafe { CStr::from_ptr(sg_version_in_lib()) };
    assert_eq!(v.to_bytes_with_nul(), sys::SG_VERSION);
    // SAFETY: nothing from the library is used after this.
    assert_eq!(unsafe { libc::dlclose(lib) }, 0);
}

#[test]
fn every_status_code_has_the_name_the_header_gives_it() {
    macro_rules! names {
        ($($code:ident),*) => {$(
            let name = unsafe { CStr::from_ptr(sg_status_name(sys::$code)) };
            assert_eq!(name.to_str().unwrap(), stringify!($code));
        )*};
    }
    names!(
        SG_OK,
        SG_PENDING,
        SG_NULL_POINTER,
        SG_INVALID_ARGUMENT,
        SG_INVALID_CONFIG,
        SG_TIMEOUT,
        SG_PREEMPTED,
        SG_STALE,
        SG_BUFFER_TOO_SMALL,
        SG_WRONG_THREAD,
        SG_CLOSED,
        SG_UNAVAILABLE,
        SG_PANIC,
        SG_INTERNAL
    );
    assert!(sg_status_name(-1).is_null());
    assert!(sg_status_name(sys::SG_INTERNAL + 1).is_null());
    // SAFETY: a static NUL-terminated string.
    let version = unsafe { CStr::from_ptr(sg_version()) };
    assert_eq!(version.to_str().unwrap(), env!("CARGO_PKG_VERSION"));
}

fn last_error() -> String {
    let mut len = 0;
    // SAFETY: a size query with a NULL buffer of length 0.
    unsafe { sg_last_error(ptr::null_mut(), 0, &mut len) };
    let mut buf = vec![0u8; len + 1];
    // SAFETY: `buf` holds `len + 1` bytes.
    let status = unsafe { sg_last_error(buf.as_mut_ptr().cast(), buf.len(), &mut len) };
    assert_eq!(status, sys::SG_OK);
    buf.truncate(len);
    String::from_utf8(buf).unwrap()
}

#[test]
fn null_pointers_give_null_pointer_and_name_the_argument() {
    let config = sg_config_default();
    let probe = sg_probe::default();
    let request = sg_request::default();
    let mut gate = ptr::null_mut();
    let mut lease = ptr::null_mut();
    let mut attempt = ptr::null_mut();
    let mut stats = sg_stats::default();
    let mut info = sg_lease_info::default();
    let mut text = ptr::null_mut();
    let mut len = 0;
    let mut id = ptr::null();
    // Each call, then its message: the next call replaces it.
    let check = |status, what: &str| {
        assert_eq!(status, sys::SG_NULL_POINTER, "{what}");
        let message = last_error();
        assert!(message.ends_with(&format!("`{what}` is NULL")), "{message}");
    };
    // SAFETY (every call below): each pointer is NULL or valid; NULL is what is tested.
    check(
        unsafe { sg_gate_create(ptr::null(), &probe, &mut gate) },
        "config",
    );
    check(
        unsafe { sg_gate_create(&config, ptr::null(), &mut gate) },
        "probe",
    );
    check(
        unsafe { sg_gate_create(&config, &probe, ptr::null_mut()) },
        "out_gate",
    );
    check(
        unsafe { sg_gate_create(&config, &probe, &mut gate) },
        "probe->usage",
    );
    check(
        unsafe { sg_gate_acquire(ptr::null(), &request, 0, &mut lease) },
        "gate",
    );
    let none = ptr::null_mut();
    check(
        unsafe { sg_gate_try_acquire(ptr::null(), &request, None, none, &mut attempt) },
        "gate",
    );
    check(
        unsafe { sg_gate_finish_session(ptr::null(), ptr::null(), 0, none.cast()) },
        "gate",
    );
    check(unsafe { sg_gate_stats(ptr::null(), &mut stats) }, "gate");
    check(
        unsafe { sg_gate_prometheus(ptr::null(), &mut text, &mut len) },
        "gate",
    );
    check(
        unsafe { sg_attempt_poll(ptr::null_mut(), &mut lease) },
        "attempt",
    );
    check(
        unsafe { sg_lease_get_info(ptr::null(), &mut info) },
        "lease",
    );
    check(
        unsafe { sg_lease_session_id(ptr::null(), &mut id, &mut len) },
        "lease",
    );
    check(unsafe { sg_lease_release(ptr::null_mut()) }, "lease");
    check(unsafe { sg_config_validate(ptr::null()) }, "config");
    check(unsafe { sg_config_from_env(ptr::null_mut()) }, "out");
    assert!(gate.is_null() && lease.is_null() && attempt.is_null() && text.is_null());
    // SAFETY: destroying NULL is a documented no-op.
    unsafe {
        assert_eq!(sg_gate_destroy(ptr::null_mut()), sys::SG_OK);
        assert_eq!(sg_lease_destroy(ptr::null_mut()), sys::SG_OK);
        assert_eq!(sg_attempt_destroy(ptr::null_mut()), sys::SG_OK);
        assert_eq!(sg_string_free(ptr::null_mut()), sys::SG_OK);
    }
}

#[test]
fn the_last_error_is_per_thread_sized_by_the_caller_and_kept_by_success() {
    let mut bad = sg_config_default();
    bad.idle_grace_sec = -1.0;
    // SAFETY: a valid config pointer.
    assert_eq!(unsafe { sg_config_validate(&bad) }, sys::SG_INVALID_CONFIG);
    let message = last_error();
    assert!(
        message.contains("idle_grace_sec") && message.contains("-1"),
        "{message}"
    );

    // Too small a buffer: nothing copied, the needed length reported.
    let mut small = [0x55u8; 4];
    let mut len = 0;
    // SAFETY: `small` holds 4 bytes.
    let status = unsafe { sg_last_error(small.as_mut_ptr().cast(), small.len(), &mut len) };
    assert_eq!((status, len), (sys::SG_BUFFER_TOO_SMALL, message.len()));
    assert_eq!(small, [0x55; 4]);
    // SAFETY: a non-empty buffer with a NULL pointer is refused without touching anything.
    let status = unsafe { sg_last_error(ptr::null_mut(), 8, &mut len) };
    assert_eq!(status, sys::SG_NULL_POINTER);

    // A successful call keeps the message; another thread has its own (empty) one.
    let good = sg_config_default();
    // SAFETY: a valid config pointer.
    assert_eq!(unsafe { sg_config_validate(&good) }, sys::SG_OK);
    assert_eq!(last_error(), message);
    std::thread::spawn(|| assert_eq!(last_error(), ""))
        .join()
        .unwrap();
}
