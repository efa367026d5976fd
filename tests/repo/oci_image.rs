//! `scripts/oci-image` writes a standards-compliant OCI image layout tar of the built module:
//! every digest and size in `index.json`, the manifest and the config is recomputed here from
//! the bytes, the single layer holds exactly `plugin.wasm` equal to the built module (what
//! Istio extracts), the output is reproducible, and the Istio manifests it renders carry the
//! manifest digest (what Istio verifies for `oci://` URLs). If `skopeo` is installed, it must
//! read the archive and report the same manifest digest.
// Test helpers fail loudly: that is their job.
#![allow(
    clippy::panic,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing
)]

use crate::deploy_support;
use crate::support;

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;
use sha2::{Digest, Sha256};

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The regular files of a tar, by path.
fn untar(bytes: &[u8]) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut archive = tar::Archive::new(bytes);
    for e in archive.entries().unwrap() {
        let mut e = e.unwrap();
        if e.header().entry_type() != tar::EntryType::Regular {
            continue;
        }
        let path = e.path().unwrap().display().to_string();
        let mut data = Vec::new();
        e.read_to_end(&mut data).unwrap();
        assert!(out.insert(path.clone(), data).is_none(), "{path} twice");
    }
    out
}

/// Checks a descriptor against the blobs: digest = sha256 of the blob, size = its length.
/// Returns the blob.
fn resolve<'a>(blobs: &'a BTreeMap<String, Vec<u8>>, desc: &Value, what: &str) -> &'a [u8] {
    let digest = desc["digest"].as_str().unwrap();
    let hex = digest
        .strip_prefix("sha256:")
        .unwrap_or_else(|| panic!("{what}: {digest} is not sha256"));
    let blob = blobs
        .get(&format!("blobs/sha256/{hex}"))
        .unwrap_or_else(|| panic!("{what}: blob {digest} missing"));
    assert_eq!(
        sha256_hex(blob),
        hex,
        "{what}: digest does not match content"
    );
    assert_eq!(
        desc["size"].as_u64(),
        Some(blob.len() as u64),
        "{what}: size"
    );
    blob
}

fn run_script(wasm: &Path, out: &Path, url: &str) -> Value {
    let o = Command::new(support::repo_root().join("scripts/oci-image"))
        .args(["--tag", "9.9.9", "--wasm"])
        .arg(wasm)
        .arg("--out")
        .arg(out)
        .args(["--istio-url", url])
        .env("CARGO_TARGET_DIR", support::target_dir())
        .output()
        .unwrap();
    assert!(
        o.status.success(),
        "scripts/oci-image failed:\n{}",
        String::from_utf8_lossy(&o.stderr)
    );
    let stdout = String::from_utf8_lossy(&o.stdout);
    serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
}

#[test]
fn oci_layout_digests_sizes_and_content_check_out() {
    let wasm_path = support::wasm_path();
    let wasm = std::fs::read(&wasm_path).unwrap();
    let dir: PathBuf =
        std::env::temp_dir().join(format!("computeflux-oci-{}", support::unique_u32()));
    let out = dir.join("computeflux-oci.tar");
    let url = "oci://registry.example/llm/computeflux:9.9.9";
    let summary = run_script(&wasm_path, &out, url);
    let tar_bytes = std::fs::read(&out).unwrap();
    let files = untar(&tar_bytes);

    // oci-layout and index.json.
    let layout: Value = serde_json::from_slice(&files["oci-layout"]).unwrap();
    assert_eq!(layout, serde_json::json!({"imageLayoutVersion": "1.0.0"}));
    let index: Value = serde_json::from_slice(&files["index.json"]).unwrap();
    oci_spec::image::ImageIndex::from_reader(&files["index.json"][..]).unwrap();
    assert_eq!(index["schemaVersion"], 2);
    let manifests = index["manifests"].as_array().unwrap();
    assert_eq!(manifests.len(), 1);
    let mdesc = &manifests[0];
    assert_eq!(
        mdesc["mediaType"],
        "application/vnd.oci.image.manifest.v1+json"
    );
    assert_eq!(
        mdesc["annotations"]["org.opencontainers.image.ref.name"],
        "9.9.9"
    );
    let manifest_bytes = resolve(&files, mdesc, "manifest");
    assert_eq!(summary["manifest_digest"], mdesc["digest"]);

    // The manifest: config + exactly one tar+gzip layer, the compat annotation.
    oci_spec::image::ImageManifest::from_reader(manifest_bytes).unwrap();
    let manifest: Value = serde_json::from_slice(manifest_bytes).unwrap();
    assert_eq!(manifest["schemaVersion"], 2);
    assert_eq!(
        manifest["annotations"]["module.wasm.image/variant"],
        "compat"
    );
    assert_eq!(
        manifest["config"]["mediaType"],
        "application/vnd.oci.image.config.v1+json"
    );
    let config_bytes = resolve(&files, &manifest["config"], "config");
    let layers = manifest["layers"].as_array().unwrap();
    assert_eq!(
        layers.len(),
        1,
        "Istio reads the last layer; there must be one"
    );
    assert_eq!(
        layers[0]["mediaType"],
        "application/vnd.oci.image.layer.v1.tar+gzip"
    );
    let layer = resolve(&files, &layers[0], "layer");

    // The layer: gzip of a tar holding only plugin.wasm = the built module.
    let mut layer_tar = Vec::new();
    flate2::read::GzDecoder::new(layer)
        .read_to_end(&mut layer_tar)
        .unwrap();
    let inner = untar(&layer_tar);
    assert_eq!(inner.keys().collect::<Vec<_>>(), vec!["plugin.wasm"]);
    assert!(
        inner["plugin.wasm"] == wasm,
        "plugin.wasm differs from the module"
    );
    assert_eq!(summary["wasm_sha256"], sha256_hex(&wasm));

    // The config: diff_ids = digest of the uncompressed layer.
    oci_spec::image::ImageConfiguration::from_reader(config_bytes).unwrap();
    let config: Value = serde_json::from_slice(config_bytes).unwrap();
    assert_eq!(config["rootfs"]["type"], "layers");
    assert_eq!(
        config["rootfs"]["diff_ids"],
        serde_json::json!([format!("sha256:{}", sha256_hex(&layer_tar))])
    );
    assert_eq!(config["architecture"], "wasm");

    // No stray blobs: exactly manifest, config, layer.
    let blobs: Vec<&String> = files.keys().filter(|k| k.starts_with("blobs/")).collect();
    assert_eq!(blobs.len(), 3, "{blobs:?}");

    // Reproducible: a second run writes the same bytes.
    let out2 = dir.join("again.tar");
    let summary2 = run_script(&wasm_path, &out2, url);
    assert_eq!(summary2["manifest_digest"], summary["manifest_digest"]);
    assert!(
        std::fs::read(&out2).unwrap() == tar_bytes,
        "not reproducible"
    );

    // Rendered Istio manifests carry the URL and the manifest digest.
    let digest_hex = summary["manifest_digest"]
        .as_str()
        .unwrap()
        .trim_start_matches("sha256:")
        .to_string();
    let rendered = dir.join("istio");
    let mut seen = 0;
    for f in deploy_support::files_with_ext(&rendered, &[".yaml"]) {
        for doc in deploy_support::yaml_docs(&f) {
            deploy_support::walk(&doc, String::new(), &mut |ptr, v| {
                let Some(s) = v.as_str() else { return };
                if ptr.ends_with("/url") || ptr.ends_with("/uri") {
                    if s.starts_with("oci://") {
                        assert_eq!(s, url, "{}: {ptr}", f.display());
                        seen += 1;
                    }
                } else if ptr.ends_with("/sha256") {
                    assert_eq!(s, digest_hex, "{}: {ptr}", f.display());
                }
            });
        }
    }
    assert!(
        seen >= 1,
        "no oci:// URL rendered into {}",
        rendered.display()
    );

    // A standard tool reads it (skopeo, from Debian's packages), when installed.
    match Command::new("skopeo")
        .args(["inspect", "--raw"])
        .arg(format!("oci-archive:{}:9.9.9", out.display()))
        .output()
    {
        Ok(o) => {
            assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
            assert_eq!(
                format!("sha256:{}", sha256_hex(&o.stdout)),
                summary["manifest_digest"].as_str().unwrap()
            );
        }
        Err(_) => eprintln!("note: skopeo not installed; the layout was checked by this test only"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dockerfile_builds_the_same_single_layer_shape() {
    let text = std::fs::read_to_string(support::repo_root().join("envoy/Dockerfile.wasm")).unwrap();
    let instructions: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    assert_eq!(
        instructions,
        vec!["FROM scratch", "COPY computeflux.wasm /plugin.wasm"]
    );
    // The build context named in its usage line holds the module.
    assert!(text.contains("target/wasm32-wasip1/release"));
    assert_eq!(
        support::wasm_path().file_name().unwrap(),
        "computeflux.wasm"
    );
}
