//! The exact cost harness (issue 21, item 1): how many instructions the filter executes per
//! request, counted, not timed.
//!
//! Why: Envoy CPU per request measured with wrk scatters by tens of microseconds between rounds
//! on shared machines, so a change of a few microseconds cannot be decided that way. A wasm
//! module's executed instructions can be counted exactly: this crate runs the release
//! `computeflux.wasm` and the floor module (`examples/floor_filter.rs`, the least a body-routing
//! filter does) under wasmtime with fuel metering, behind an in-memory proxy-wasm host
//! ([`host`]), through complete request lifecycles ([`scenario`]). Per request it reports the
//! instructions, the host calls by kind and the bytes copied across the boundary; the counts
//! are the same on every run and machine.
//!
//! Copies inside the module are counted: a bulk-memory operator (`memory.copy`, `memory.fill`,
//! which Rust's `memcpy`/`memset` become on wasm32-wasip1) costs one unit of fuel per byte on
//! top of its own (wasmtime 48's default variable operator costs; a 24 KB `Vec` clone measured
//! 24 400). What the counts do not see: the boundary copies (in the bytes columns) and the
//! host's own work (Envoy's header maps, V8's call overhead), only the number of host calls. Envoy's local replies, chunking and CAS are modelled as
//! [`scenario`] and [`host`] describe, not run.
//!
//! `cargo test -p computeflux-cost` compares them with the committed `budgets.json` and fails
//! on a regression above its margin; `cargo run -p computeflux-cost -- --print` prints the
//! table (see `src/main.rs`).

pub mod fleet;
pub mod host;
pub mod scenario;
pub mod vm;

use scenario::{Module, Setup, Suite, SCENARIOS};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use wasmtime::{bail, Result};

/// Endpoint counts the budgets cover.
pub const ENDPOINT_COUNTS: [usize; 3] = [4, 64, 512];

/// The repository root (two levels above this crate).
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Cargo's target directory (`CARGO_TARGET_DIR` if set, else `<repo>/target`).
pub fn target_dir() -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(d) if Path::new(&d).is_absolute() => PathBuf::from(d),
        Some(d) => repo_root().join(d),
        None => repo_root().join("target"),
    }
}

/// The two modules: `$COMPUTEFLUX_WASM` / `$COMPUTEFLUX_FLOOR_WASM` if set (as scripts/bench
/// exports them), else built here with the commands scripts/bench uses (a no-op when fresh),
/// so the counts are never those of a stale module.
pub fn locate_modules() -> Result<(PathBuf, PathBuf)> {
    let filter = match std::env::var_os("COMPUTEFLUX_WASM") {
        Some(p) => PathBuf::from(p),
        None => {
            cargo_build(&["build", "--release", "--target", "wasm32-wasip1", "--lib"])?;
            target_dir().join("wasm32-wasip1/release/computeflux.wasm")
        }
    };
    let floor = match std::env::var_os("COMPUTEFLUX_FLOOR_WASM") {
        Some(p) => PathBuf::from(p),
        None => {
            cargo_build(&[
                "build",
                "--release",
                "--target",
                "wasm32-wasip1",
                "--example",
                "floor_filter",
            ])?;
            target_dir().join("wasm32-wasip1/release/examples/floor_filter.wasm")
        }
    };
    for p in [&filter, &floor] {
        if !p.is_file() {
            bail!("wasm module missing at {}", p.display());
        }
    }
    Ok((filter, floor))
}

fn cargo_build(args: &[&str]) -> Result<()> {
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let out = Command::new(cargo)
        .args(args)
        .current_dir(repo_root())
        .env("CARGO_TARGET_DIR", target_dir())
        .output()?;
    if !out.status.success() {
        bail!(
            "cargo {} failed ({}):\n{}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// Every suite the budgets and the table cover: the filter at each endpoint count (and, at 4
/// and 512 endpoints, with usage accounting and quota awareness off, to isolate what reading
/// usage and quota headers costs; at every count with `prefix_placement` off, to isolate what
/// placement by prefix costs), and the floor once (it knows no endpoints), as it is and
/// parsing the body for its `model` (what reading the routing field alone costs).
pub fn setups() -> Vec<(Module, Setup, &'static str)> {
    let mut v = Vec::new();
    for n in ENDPOINT_COUNTS {
        v.push((Module::Filter, Setup::new(n), ""));
    }
    for n in [4, 512] {
        v.push((
            Module::Filter,
            Setup {
                usage_accounting: false,
                ..Setup::new(n)
            },
            "no_usage",
        ));
        v.push((
            Module::Filter,
            Setup {
                quota_aware: false,
                ..Setup::new(n)
            },
            "no_quota",
        ));
    }
    for n in ENDPOINT_COUNTS {
        v.push((
            Module::Filter,
            Setup {
                prefix_placement: false,
                ..Setup::new(n)
            },
            "no_prefix",
        ));
    }
    v.push((Module::Floor, Setup::new(1), ""));
    v.push((Module::FloorModel, Setup::new(1), ""));
    v
}

/// Endpoint counts of the suites with every endpoint scraped (see [`fleet`]).
pub const SCRAPE_COUNTS: [usize; 4] = [4, 64, 512, 1024];
/// Host counts of the pool suites (see [`fleet`]).
pub const POOL_HOSTS: [usize; 3] = [4, 64, 1000];
/// The scrape interval of the scraping suites: long enough that every load stays fresh
/// (`3 ×` the interval) through the scenarios after the one scrape round. The instructions of
/// a request, a tick or an answer do not depend on it; how often they run does (see
/// [`fleet_markdown`], which counts them at the default 250 ms).
pub const SCRAPE_INTERVAL_MS: u64 = 2_000;
/// The default scrape interval, for the per-second figures.
pub const DEFAULT_SCRAPE_INTERVAL_MS: u64 = 250;

/// The fleet suites: every endpoint scraped at [`SCRAPE_COUNTS`], a pool of [`POOL_HOSTS`].
pub fn fleet_setups() -> Vec<(Module, Setup, &'static str)> {
    let mut v = Vec::new();
    for n in SCRAPE_COUNTS {
        v.push((
            Module::Filter,
            Setup {
                scrape_interval_ms: Some(SCRAPE_INTERVAL_MS),
                ..Setup::new(n)
            },
            "scrape",
        ));
    }
    for n in POOL_HOSTS {
        v.push((
            Module::Filter,
            Setup {
                pool: true,
                ..Setup::new(n)
            },
            "pool",
        ));
    }
    v
}

/// A suite's name in tables and budgets: `filter/4`, `filter/512/no_usage`, `floor`.
pub fn suite_key(module: Module, setup: Setup, variant: &str) -> String {
    match (module, variant) {
        (Module::Floor, _) => "floor".to_string(),
        (Module::FloorModel, _) => "floor/read_model".to_string(),
        (Module::Filter, "") => format!("filter/{}", setup.endpoints),
        (Module::Filter, v) => format!("filter/{}/{v}", setup.endpoints),
    }
}

/// Both modules, compiled once (compiling takes longer than running every suite).
pub struct Modules {
    filter: vm::Loaded,
    floor: vm::Loaded,
}

impl Modules {
    /// The filter's compiled module.
    pub fn filter(&self) -> &vm::Loaded {
        &self.filter
    }

    pub fn compile(filter_wasm: &[u8], floor_wasm: &[u8]) -> Result<Modules> {
        Ok(Modules {
            filter: vm::Loaded::new(filter_wasm)?,
            floor: vm::Loaded::new(floor_wasm)?,
        })
    }

    /// [`Modules::compile`] of the files [`locate_modules`] finds.
    pub fn locate_and_compile() -> Result<Modules> {
        let (filter, floor) = locate_modules()?;
        Modules::compile(&std::fs::read(&filter)?, &std::fs::read(&floor)?)
    }
}

/// Runs every suite, each in a fresh VM; `(key, suite)` in [`setups`] order.
pub fn run_all(modules: &Modules) -> Result<Vec<(String, Suite)>> {
    run_setups(modules, setups())
}

/// Runs the given suites, each in a fresh VM.
pub fn run_setups(
    modules: &Modules,
    setups: Vec<(Module, Setup, &'static str)>,
) -> Result<Vec<(String, Suite)>> {
    let mut out = Vec::new();
    for (module, setup, variant) in setups {
        let loaded = match module {
            Module::Filter => &modules.filter,
            Module::Floor | Module::FloorModel => &modules.floor,
        };
        let key = suite_key(module, setup, variant);
        let suite = match scenario::run_suite(loaded, module, setup) {
            Ok(s) => s,
            Err(e) => bail!("{key}: {e:?}"),
        };
        out.push((key, suite));
    }
    Ok(out)
}

/// The flat map the budgets file holds: `"filter/64/body_32k" → instructions`, plus each
/// suite's `startup` and `tick`.
pub fn instruction_counts(suites: &[(String, Suite)]) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for (key, s) in suites {
        m.insert(format!("{key}/startup"), s.startup.instructions);
        m.insert(format!("{key}/tick"), s.tick.instructions);
        for r in &s.requests {
            m.insert(format!("{key}/{}", r.name), r.instructions);
        }
    }
    m
}

pub(crate) fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(' ');
        }
        out.push(c);
    }
    out
}

/// The markdown report: a summary (instructions per scenario, filter vs floor), then per
/// suite the host calls, bytes and instructions per callback.
pub fn markdown(suites: &[(String, Suite)]) -> String {
    let mut md = String::new();
    let get = |key: &str| suites.iter().find(|(k, _)| k == key).map(|(_, s)| s);
    let floor = get("floor");
    let _ = writeln!(
        md,
        "### Instructions per request (wasmtime fuel; exact, deterministic)\n"
    );
    let mut cols: Vec<&str> = vec!["floor", "floor/read_model"];
    let filter_keys: Vec<String> = ENDPOINT_COUNTS
        .iter()
        .map(|n| format!("filter/{n}"))
        .collect();
    cols.extend(filter_keys.iter().map(String::as_str));
    let _ = write!(md, "| scenario |");
    for c in &cols {
        let _ = write!(md, " {c} |");
    }
    let _ = writeln!(
        md,
        " own logic at 4 (filter − floor) | beyond reading `model` (filter − floor/read_model) | 512 ÷ 4 |"
    );
    let _ = write!(md, "|---|");
    for _ in &cols {
        let _ = write!(md, "---:|");
    }
    let _ = writeln!(md, "---:|---:|---:|");
    let mut rows: Vec<&str> = SCENARIOS.to_vec();
    rows.extend(["startup", "tick"]);
    for row in rows {
        let count = |key: &str| -> Option<u64> {
            let s = get(key)?;
            match row {
                "startup" => Some(s.startup.instructions),
                "tick" => Some(s.tick.instructions),
                r => s.request(r).map(|m| m.instructions),
            }
        };
        let _ = write!(md, "| {row} |");
        for c in &cols {
            let _ = write!(
                md,
                " {} |",
                count(c).map(thousands).unwrap_or_else(|| "–".into())
            );
        }
        let f4 = count("filter/4");
        let beyond = |floor: &str| match (f4, count(floor)) {
            (Some(f), Some(fl)) => format!(
                "{} ({:.1}× floor)",
                thousands(f.saturating_sub(fl)),
                (f.saturating_sub(fl)) as f64 / count("floor").unwrap_or(fl).max(1) as f64
            ),
            _ => "–".into(),
        };
        let (own, beyond_model) = (beyond("floor"), beyond("floor/read_model"));
        let ratio = match (f4, count("filter/512")) {
            (Some(a), Some(b)) => format!("{:.2}", b as f64 / a.max(1) as f64),
            _ => "–".into(),
        };
        let _ = writeln!(md, " {own} | {beyond_model} | {ratio} |");
    }

    // What usage accounting and quota awareness cost: the same suite with the switch off.
    let _ = writeln!(
        md,
        "\n### Reading usage and quota headers (instructions; on − off)\n"
    );
    let _ = writeln!(
        md,
        "| endpoints | scenario | usage_accounting | quota_aware |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|");
    for n in [4, 512] {
        let on = get(&format!("filter/{n}"));
        let nu = get(&format!("filter/{n}/no_usage"));
        let nq = get(&format!("filter/{n}/no_quota"));
        for row in ["new_session", "affinity_hit", "streamed_usage", "failover"] {
            let diff = |off: Option<&Suite>| -> String {
                match (
                    on.and_then(|s| s.request(row)),
                    off.and_then(|s| s.request(row)),
                ) {
                    (Some(a), Some(b)) => {
                        format!("{:+}", a.instructions as i64 - b.instructions as i64)
                    }
                    _ => "–".into(),
                }
            };
            let _ = writeln!(md, "| {n} | {row} | {} | {} |", diff(nu), diff(nq));
        }
    }

    // What placement by prefix costs (issue 20: at most 5 % of the filter's own cost): the
    // same suite with `prefix_placement` off, which neither hashes the instructions nor
    // derives a prefix key. `*_prefix` rows send a 3 000-byte system prompt (a prefix key);
    // the others the harness's 29-byte one (hashed, too short for a key).
    let _ = writeln!(
        md,
        "\n### Placement by prefix (instructions; `prefix_placement` on vs off)\n"
    );
    let _ = writeln!(
        md,
        "| endpoints | scenario | on | off | on − off | of the request | of the filter's own (− floor) |"
    );
    let _ = writeln!(md, "|---:|---|---:|---:|---:|---:|---:|");
    for n in ENDPOINT_COUNTS {
        let on = get(&format!("filter/{n}"));
        let off = get(&format!("filter/{n}/no_prefix"));
        for row in [
            "new_session",
            "affinity_hit",
            "new_session_prefix",
            "affinity_hit_prefix",
        ] {
            let count = |s: Option<&Suite>| s.and_then(|s| s.request(row)).map(|m| m.instructions);
            let (Some(a), Some(b)) = (count(on), count(off)) else {
                continue;
            };
            let fl = count(floor).unwrap_or(0);
            let d = a as i64 - b as i64;
            let own = b.saturating_sub(fl).max(1);
            let _ = writeln!(
                md,
                "| {n} | {row} | {} | {} | {d:+} | {:+.2} % | {:+.2} % |",
                thousands(a),
                thousands(b),
                d as f64 * 100.0 / b.max(1) as f64,
                d as f64 * 100.0 / own as f64
            );
        }
    }

    // Details per suite.
    let _ = writeln!(
        md,
        "\n### Per request: host calls, bytes across the boundary, instructions per callback\n"
    );
    for (key, s) in suites {
        if key.contains("/no_") {
            continue;
        }
        let _ = writeln!(md, "#### {key}\n");
        let _ = writeln!(
            md,
            "| scenario | outcome | instructions | host calls | bytes in | bytes out | calls by kind | instructions by callback |"
        );
        let _ = writeln!(md, "|---|---|---:|---:|---:|---:|---|---|");
        for m in std::iter::once(&s.startup)
            .chain(std::iter::once(&s.tick))
            .chain(s.requests.iter())
        {
            let calls: Vec<String> = m
                .traffic
                .calls
                .iter()
                .map(|(k, v)| format!("{}×{v}", k.trim_start_matches("proxy_")))
                .collect();
            let cbs: Vec<String> = m
                .by_callback
                .iter()
                .map(|(k, v)| format!("{} {}", k.trim_start_matches("proxy_on_"), thousands(*v)))
                .collect();
            let _ = writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                m.name,
                m.outcome,
                thousands(m.instructions),
                m.traffic.total_calls(),
                m.traffic.bytes_in,
                m.traffic.bytes_out,
                calls.join(", "),
                cbs.join(", ")
            );
        }
        let _ = writeln!(md);
    }
    let _ = floor;
    md
}

/// The committed budgets: `margin_percent` and `instructions` per `suite/scenario`.
pub struct Budgets {
    pub margin_percent: f64,
    pub instructions: BTreeMap<String, u64>,
}

pub fn budgets_path() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("budgets.json")
}

impl Budgets {
    pub fn load(path: &Path) -> Result<Budgets> {
        let text = std::fs::read_to_string(path)?;
        let v: serde_json::Value = serde_json::from_str(&text)?;
        let Some(margin_percent) = v.get("margin_percent").and_then(|m| m.as_f64()) else {
            bail!("{}: no numeric margin_percent", path.display());
        };
        let Some(map) = v.get("instructions").and_then(|m| m.as_object()) else {
            bail!("{}: no instructions object", path.display());
        };
        let mut instructions = BTreeMap::new();
        for (k, n) in map {
            let Some(n) = n.as_u64() else {
                bail!("{}: instructions.{k} is not a count", path.display());
            };
            instructions.insert(k.clone(), n);
        }
        Ok(Budgets {
            margin_percent,
            instructions,
        })
    }

    /// The file for `counts` (what `--write-budgets` commits).
    pub fn render(margin_percent: f64, counts: &BTreeMap<String, u64>) -> String {
        let mut v = serde_json::Map::new();
        v.insert(
            "about".into(),
            "Instructions (wasmtime fuel) per request of tests/cost's scenarios; cargo test -p computeflux-cost fails when one exceeds its budget by more than margin_percent. Regenerate with: cargo run -p computeflux-cost -- --write-budgets".into(),
        );
        v.insert("margin_percent".into(), margin_percent.into());
        let counts: serde_json::Map<String, serde_json::Value> = counts
            .iter()
            .map(|(k, n)| (k.clone(), (*n).into()))
            .collect();
        v.insert("instructions".into(), counts.into());
        let mut s = serde_json::to_string_pretty(&serde_json::Value::Object(v)).unwrap_or_default();
        s.push('\n');
        s
    }

    /// Problems: counts above budget × (1 + margin), counts without a budget, budgets without
    /// a count. Counts far below budget are only noted (`notes`), so that an improvement is
    /// committed by regenerating the file.
    pub fn check(&self, counts: &BTreeMap<String, u64>) -> (Vec<String>, Vec<String>) {
        let mut problems = Vec::new();
        let mut notes = Vec::new();
        for (k, &n) in counts {
            match self.instructions.get(k) {
                None => problems.push(format!("{k}: {n} instructions, no budget")),
                Some(&b) => {
                    let limit = b as f64 * (1.0 + self.margin_percent / 100.0);
                    if n as f64 > limit {
                        problems.push(format!(
                            "{k}: {n} instructions > budget {b} + {}% ({:+.1}%)",
                            self.margin_percent,
                            (n as f64 / b as f64 - 1.0) * 100.0
                        ));
                    } else if (n as f64) < b as f64 * (1.0 - self.margin_percent / 100.0) {
                        notes.push(format!(
                            "{k}: {n} instructions, {:+.1}% under budget {b} (regenerate budgets.json to keep the gain)",
                            (n as f64 / b as f64 - 1.0) * 100.0
                        ));
                    }
                }
            }
        }
        for k in self.instructions.keys() {
            if !counts.contains_key(k) {
                problems.push(format!("{k}: budgeted but not measured"));
            }
        }
        (problems, notes)
    }
}

/// Where the instructions go (`computeflux-cost --profile SCENARIO ENDPOINTS [RUNS]`): the
/// suite of `ENDPOINTS` run `RUNS` times with the wasm stack sampled at a fixed wall-clock
/// interval while `SCENARIO` runs; functions by share of samples, self and inclusive.
///
/// Sampled, not counted: a share estimates the function's part of the scenario's instructions
/// (cranelift compiles without optimisation here, so machine code per wasm operator varies
/// little), and time the host spends in a call is charged to the wasm code that runs next.
/// The module is built with its function names kept (`strip` off, its own target directory)
/// unless `$COMPUTEFLUX_WASM` names one. With `$COMPUTEFLUX_COST_SCRAPE` set, the fleet's
/// scraping suite (every endpoint scraped, every load fresh).
#[cfg(feature = "profile")]
pub mod profile {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;

    pub fn run(scenario_name: &str, endpoints: usize, runs: usize) -> Result<String> {
        let wasm = match std::env::var_os("COMPUTEFLUX_WASM") {
            Some(p) => PathBuf::from(p),
            None => {
                let dir = target_dir().join("cost-profile");
                let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
                let out = Command::new(cargo)
                    .args(["build", "--release", "--target", "wasm32-wasip1", "--lib"])
                    .current_dir(repo_root())
                    .env("CARGO_TARGET_DIR", &dir)
                    .env("CARGO_PROFILE_RELEASE_STRIP", "false")
                    .output()?;
                if !out.status.success() {
                    bail!("{}", String::from_utf8_lossy(&out.stderr));
                }
                dir.join("wasm32-wasip1/release/computeflux.wasm")
            }
        };
        let loaded = vm::Loaded::profiling(&std::fs::read(&wasm)?)?;
        let stop = Arc::new(AtomicBool::new(false));
        let ticker = {
            let (engine, stop) = (loaded.engine.clone(), stop.clone());
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    std::thread::sleep(std::time::Duration::from_micros(20));
                    engine.increment_epoch();
                }
            })
        };
        let mut samples: BTreeMap<Vec<String>, u64> = BTreeMap::new();
        let mut instructions = 0;
        for _ in 0..runs {
            let (suite, s) = scenario::run_suite_sampling(
                &loaded,
                Module::Filter,
                Setup {
                    scrape_interval_ms: std::env::var_os("COMPUTEFLUX_COST_SCRAPE")
                        .map(|_| SCRAPE_INTERVAL_MS),
                    ..Setup::new(endpoints)
                },
                Some(scenario_name),
            )?;
            instructions = match scenario_name {
                "tick" => suite.tick.instructions,
                n => suite.request(n).map_or(0, |m| m.instructions),
            };
            for (k, v) in s {
                *samples.entry(k).or_insert(0) += v;
            }
        }
        stop.store(true, Ordering::Relaxed);
        let _ = ticker.join();
        let total: u64 = samples.values().sum();
        let mut own: BTreeMap<&str, u64> = BTreeMap::new();
        let mut all: BTreeMap<&str, u64> = BTreeMap::new();
        for (stack, n) in &samples {
            if let Some(top) = stack.first() {
                *own.entry(top).or_insert(0) += n;
            }
            let mut seen: Vec<&str> = Vec::new();
            for f in stack {
                if !seen.contains(&f.as_str()) {
                    seen.push(f);
                    *all.entry(f).or_insert(0) += n;
                }
            }
        }
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{scenario_name} at {endpoints} endpoints: {} instructions, {total} samples over {runs} runs",
            thousands(instructions)
        );
        for (title, m) in [("self", &own), ("inclusive", &all)] {
            let mut v: Vec<(&str, u64)> = m.iter().map(|(k, v)| (*k, *v)).collect();
            v.sort_by_key(|e| std::cmp::Reverse(e.1));
            let _ = writeln!(out, "\n{title}:");
            for (f, n) in v.iter().take(60) {
                let share = *n as f64 / total.max(1) as f64;
                let _ = writeln!(
                    out,
                    "{:5.1}% {:>10}  {f}",
                    share * 100.0,
                    thousands((share * instructions as f64) as u64)
                );
            }
        }
        Ok(out)
    }
}
