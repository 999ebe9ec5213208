//! A hello-world `lambda_http` function with response streaming: the baseline of the cold-start measurement in
//! docs/benchmarks.md (serverless section), built exactly as `loams-lambda` is
//! (`cargo build --profile aws-lambda -p loams --features aws --example hello_lambda`).

use std::convert::Infallible;

fn main() -> Result<(), lambda_http::Error> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    runtime.block_on(lambda_http::run_with_streaming_response(
        lambda_http::service_fn(|_request: lambda_http::Request| async {
            Ok::<_, Infallible>(http::Response::new(axum::body::Body::from("hello")))
        }),
    ))
}
