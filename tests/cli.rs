//! The `session-gate` command line shared by the binary and the wheel's console script: exit
//! codes instead of `process::exit`, so an embedding Python interpreter shuts down normally.
#![cfg(feature = "proxy")]
use session_gate::cli::run;

#[test]
fn help_and_version_succeed() {
    assert_eq!(run(["session-gate", "--help"]), 0);
    assert_eq!(run(["session-gate", "proxy", "--help"]), 0);
    assert_eq!(run(["session-gate", "--version"]), 0);
}

#[test]
fn usage_and_configuration_errors_exit_2() {
    assert_eq!(run(["session-gate"]), 2, "a subcommand is required");
    assert_eq!(run(["session-gate", "proxy"]), 2, "no replica");
    assert_eq!(run(["session-gate", "proxy", "--replica", "ftp://x"]), 2);
    assert_eq!(
        run([
            "session-gate",
            "proxy",
            "--high-watermark",
            "2",
            "--replica",
            "http://a:1"
        ]),
        2
    );
}

#[test]
fn sim_without_the_python_package_is_explained_not_run() {
    assert_eq!(run(["session-gate", "sim", "--profile", "cpu-tiny"]), 2);
}
