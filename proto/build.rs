//! Generates the prost message types and their canonical proto3-JSON serde impls (pbjson) from `loams/**/*.proto`.
//! protoc comes from protoc-bin-vendored so no system protoc is needed.

use std::error::Error;
use std::path::PathBuf;

const PROTOS: &[&str] = &[
    "loams/factory/v1/factory.proto",
    "loams/approvals/v1/approvals.proto",
    "loams/devices/v1/devices.proto",
    "loams/bot/v1/bot.proto",
    "loams/collab/v1/collab.proto",
];

fn main() -> Result<(), Box<dyn Error>> {
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("loams_descriptor.bin");

    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }

    prost_build::Config::new()
        .protoc_executable(protoc_bin_vendored::protoc_bin_path()?)
        .file_descriptor_set_path(&descriptor_path)
        // `prost::Name` gives error details their type name.
        .enable_type_names()
        .compile_protos(PROTOS, &["."])?;

    let descriptors = std::fs::read(&descriptor_path)?;
    pbjson_build::Builder::new()
        .register_descriptors(&descriptors)?
        // A newer client may send fields this server does not know yet; proto3 JSON lets us skip them.
        .ignore_unknown_fields()
        .build(&[".loams"])?;
    Ok(())
}
