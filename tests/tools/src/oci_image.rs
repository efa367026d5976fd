//! Packages the filter's wasm module as an OCI image that Istio (`WasmPlugin` /
//! `TrafficExtension` with an `oci://` URL) can pull, without Docker: an OCI image layout
//! (`oci-layout`, `index.json`, `blobs/sha256/…`) written as one tar file.
//!
//! Why this format: Istio accepts three Wasm image shapes (istio `pkg/wasm/imagefetcher.go`);
//! this writes the *compat* variant of the Wasm image spec with the standard OCI media types
//! (solo-io/wasm `spec/spec-compat.md`): exactly one `application/vnd.oci.image.layer.v1.tar+gzip`
//! layer holding `plugin.wasm`, an ordinary `application/vnd.oci.image.config.v1+json` config,
//! and the manifest annotation `module.wasm.image/variant: compat`. It is the same shape that
//! `docker build -f envoy/Dockerfile.wasm` produces (there with Docker media types), so any
//! registry and tool handles it.
//!
//! The output is reproducible: fixed timestamps, owners and modes, gzip without a name or time,
//! no `created` date. The same module always gives the same manifest digest, which is the
//! `sha256` that Istio checks for an OCI URL (the *manifest* digest, not the module's).
//!
//! ```text
//! cargo run -p computeflux-tools --bin oci_image -- --wasm target/wasm32-wasip1/release/computeflux.wasm \
//!     --out target/oci/computeflux-oci.tar [--tag 0.1.0]
//! ```
//! Prints one JSON line: `{"manifest_digest","manifest_size","config_digest","layer_digest",
//! "wasm_sha256","tag","out"}`. Push with e.g. `skopeo copy --preserve-digests
//! oci-archive:target/oci/computeflux-oci.tar:0.1.0 docker://REGISTRY/computeflux:0.1.0`.

use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use flate2::{Compression, GzBuilder};
use oci_spec::image::{
    Arch, DescriptorBuilder, ImageConfigurationBuilder, ImageIndexBuilder, ImageManifestBuilder,
    MediaType, OciLayoutBuilder, Os, RootFsBuilder, Sha256Digest, ANNOTATION_REF_NAME,
    ANNOTATION_TITLE,
};
use sha2::{Digest, Sha256};

/// The file name Istio looks for in the layer.
const PLUGIN_FILE: &str = "plugin.wasm";
const VARIANT_ANNOTATION: &str = "module.wasm.image/variant";

struct Args {
    wasm: PathBuf,
    out: PathBuf,
    tag: String,
}

fn parse() -> Result<Args, String> {
    let mut wasm = None;
    let mut out = None;
    let mut tag = env!("CARGO_PKG_VERSION").to_string();
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--wasm" => wasm = Some(PathBuf::from(value()?)),
            "--out" => out = Some(PathBuf::from(value()?)),
            "--tag" => tag = value()?,
            "-h" | "--help" => {
                return Err("usage: oci_image --wasm FILE --out FILE.tar [--tag TAG]".into())
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    Ok(Args {
        wasm: wasm.ok_or("--wasm is required")?,
        out: out.ok_or("--out is required")?,
        tag,
    })
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn digest(bytes: &[u8]) -> Result<Sha256Digest, String> {
    sha256_hex(bytes)
        .parse::<Sha256Digest>()
        .map_err(|e| e.to_string())
}

/// A tar entry header with fixed metadata (reproducible output).
fn header(path: &str, size: u64, dir: bool) -> Result<tar::Header, String> {
    let mut h = tar::Header::new_ustar();
    h.set_path(path).map_err(|e| e.to_string())?;
    h.set_size(size);
    h.set_mode(if dir { 0o755 } else { 0o644 });
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_entry_type(if dir {
        tar::EntryType::Directory
    } else {
        tar::EntryType::Regular
    });
    h.set_cksum();
    Ok(h)
}

fn tar_file<W: Write>(b: &mut tar::Builder<W>, path: &str, data: &[u8]) -> Result<(), String> {
    let h = header(path, data.len() as u64, false)?;
    b.append(&h, data).map_err(|e| e.to_string())
}

fn build(args: &Args) -> Result<serde_json::Value, String> {
    let wasm =
        std::fs::read(&args.wasm).map_err(|e| format!("reading {}: {e}", args.wasm.display()))?;
    if wasm.get(..4) != Some(b"\0asm".as_slice()) {
        return Err(format!("{} is not a wasm module", args.wasm.display()));
    }

    // The layer: a tar with plugin.wasm, gzip-compressed. diff_id = digest of the tar.
    let mut layer_tar = tar::Builder::new(Vec::new());
    tar_file(&mut layer_tar, PLUGIN_FILE, &wasm)?;
    let layer_tar = layer_tar.into_inner().map_err(|e| e.to_string())?;
    let mut gz = GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), Compression::best());
    gz.write_all(&layer_tar).map_err(|e| e.to_string())?;
    let layer = gz.finish().map_err(|e| e.to_string())?;

    let config = ImageConfigurationBuilder::default()
        .architecture(Arch::Wasm)
        .os(Os::Other("wasip1".into()))
        .rootfs(
            RootFsBuilder::default()
                .typ("layers")
                .diff_ids(vec![format!("sha256:{}", sha256_hex(&layer_tar))])
                .build()
                .map_err(|e| e.to_string())?,
        )
        .build()
        .map_err(|e| e.to_string())?;
    let config = config.to_string().map_err(|e| e.to_string())?.into_bytes();

    let layer_desc = DescriptorBuilder::default()
        .media_type(MediaType::ImageLayerGzip)
        .size(layer.len() as u64)
        .digest(digest(&layer)?)
        .annotations(HashMap::from([(
            ANNOTATION_TITLE.to_string(),
            PLUGIN_FILE.to_string(),
        )]))
        .build()
        .map_err(|e| e.to_string())?;
    let config_desc = DescriptorBuilder::default()
        .media_type(MediaType::ImageConfig)
        .size(config.len() as u64)
        .digest(digest(&config)?)
        .build()
        .map_err(|e| e.to_string())?;
    let manifest = ImageManifestBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageManifest)
        .config(config_desc)
        .layers(vec![layer_desc])
        .annotations(HashMap::from([(
            VARIANT_ANNOTATION.to_string(),
            "compat".to_string(),
        )]))
        .build()
        .map_err(|e| e.to_string())?;
    let manifest = manifest
        .to_string()
        .map_err(|e| e.to_string())?
        .into_bytes();
    let manifest_digest = digest(&manifest)?;

    let index = ImageIndexBuilder::default()
        .schema_version(2u32)
        .media_type(MediaType::ImageIndex)
        .manifests(vec![DescriptorBuilder::default()
            .media_type(MediaType::ImageManifest)
            .size(manifest.len() as u64)
            .digest(manifest_digest.clone())
            .annotations(HashMap::from([(
                ANNOTATION_REF_NAME.to_string(),
                args.tag.clone(),
            )]))
            .build()
            .map_err(|e| e.to_string())?])
        .build()
        .map_err(|e| e.to_string())?;
    let index = index.to_string().map_err(|e| e.to_string())?.into_bytes();
    let layout = OciLayoutBuilder::default()
        .image_layout_version("1.0.0")
        .build()
        .map_err(|e| e.to_string())?
        .to_string()
        .map_err(|e| e.to_string())?
        .into_bytes();

    // The layout, as one tar (what `oci-archive:` transports read).
    let mut out = tar::Builder::new(Vec::new());
    tar_file(&mut out, "oci-layout", &layout)?;
    tar_file(&mut out, "index.json", &index)?;
    for dir in ["blobs/", "blobs/sha256/"] {
        let h = header(dir, 0, true)?;
        out.append(&h, std::io::empty())
            .map_err(|e| e.to_string())?;
    }
    let mut blobs = vec![
        (sha256_hex(&config), &config),
        (sha256_hex(&layer), &layer),
        (sha256_hex(&manifest), &manifest),
    ];
    blobs.sort();
    for (hex, data) in blobs {
        tar_file(&mut out, &format!("blobs/sha256/{hex}"), data)?;
    }
    let out = out.into_inner().map_err(|e| e.to_string())?;
    if let Some(dir) = args.out.parent() {
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
    }
    std::fs::write(&args.out, out).map_err(|e| format!("writing {}: {e}", args.out.display()))?;

    Ok(serde_json::json!({
        "manifest_digest": format!("sha256:{}", manifest_digest.digest()),
        "manifest_size": manifest.len(),
        "config_digest": format!("sha256:{}", sha256_hex(&config)),
        "layer_digest": format!("sha256:{}", sha256_hex(&layer)),
        "wasm_sha256": sha256_hex(&wasm),
        "tag": args.tag,
        "out": args.out.display().to_string(),
    }))
}

fn main() -> ExitCode {
    match parse().and_then(|a| build(&a)) {
        Ok(summary) => {
            println!("{summary}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("oci_image: {e}");
            ExitCode::from(2)
        }
    }
}
