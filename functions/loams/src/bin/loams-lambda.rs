//! `loams-lambda`: every Loams Lambda function in one binary; `LOAMS_FUNCTION` picks which (see `loams::lambda`).

use std::process::ExitCode;

fn main() -> ExitCode {
    // Lambda sends stderr to CloudWatch Logs; no ANSI colours there.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("LOAMS_LOG")
                .unwrap_or_else(|_| "info".into()),
        )
        .with_ansi(false)
        .without_time()
        .with_writer(std::io::stderr)
        .init();
    let settings = match loams::lambda::Settings::from_env() {
        Ok(settings) => settings,
        Err(e) => {
            eprintln!("loams-lambda: {e}");
            return ExitCode::FAILURE;
        }
    };
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("loams-lambda: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(loams::lambda::run(settings)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("loams-lambda: {e:#}");
            ExitCode::FAILURE
        }
    }
}
