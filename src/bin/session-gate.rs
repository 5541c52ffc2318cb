//! `session-gate`: the command-line entry point (the parser and subcommands live in
//! [`session_gate::cli`], shared with the wheel's console script).
use std::process::ExitCode;

fn main() -> ExitCode {
    let code = session_gate::cli::run(std::env::args_os());
    ExitCode::from(u8::try_from(code).unwrap_or(1))
}
