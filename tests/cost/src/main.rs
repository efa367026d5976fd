//! `computeflux-cost`: runs the exact cost harness and reports.
//!
//!   computeflux-cost --print            the markdown table (stdout)
//!   computeflux-cost --check            compare with budgets.json; exit 1 on a regression
//!   computeflux-cost --write-budgets    rewrite budgets.json from this run (margin kept)
//!   computeflux-cost --json             every count as JSON (stdout)
//!   computeflux-cost --suite KEY        one suite (`filter/512/scrape`) in detail; with
//!                                       COMPUTEFLUX_COST_ECHO=1, every host call with the
//!                                       instructions so far (stderr)
//!   computeflux-cost --fleet            the fleet report (stdout): scraping at 4 … 1 024
//!                                       endpoints, pools of 4 … 1 000 hosts, departures
//!                                       (see `computeflux_cost::fleet`)
//!   computeflux-cost --profile SCENARIO ENDPOINTS [RUNS]
//!                                       where SCENARIO's instructions go, sampled (needs
//!                                       `--features profile`; see `computeflux_cost::profile`)
//!
//! The modules are `$COMPUTEFLUX_WASM` and `$COMPUTEFLUX_FLOOR_WASM`, else built in the
//! workspace's target directory.

use computeflux_cost::scenario::Module;
use computeflux_cost::{instruction_counts, markdown, run_all, run_setups, Budgets, Modules};
use std::process::ExitCode;

fn main() -> ExitCode {
    match run() {
        Ok(code) => code,
        Err(e) => {
            eprintln!("computeflux-cost: {e:?}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> wasmtime::Result<ExitCode> {
    let mode = std::env::args().nth(1).unwrap_or_else(|| "--print".into());
    #[cfg(feature = "profile")]
    if mode == "--profile" {
        let args: Vec<String> = std::env::args().skip(2).collect();
        let scenario = args.first().map_or("new_session", String::as_str);
        let endpoints = args.get(1).and_then(|a| a.parse().ok()).unwrap_or(512);
        let runs = args.get(2).and_then(|a| a.parse().ok()).unwrap_or(20);
        print!(
            "{}",
            computeflux_cost::profile::run(scenario, endpoints, runs)?
        );
        return Ok(ExitCode::SUCCESS);
    }
    if mode == "--suite" {
        let key = std::env::args().nth(2).unwrap_or_default();
        let Some(s) = computeflux_cost::setups()
            .into_iter()
            .chain(computeflux_cost::fleet_setups())
            .find(|(m, s, v)| computeflux_cost::suite_key(*m, *s, v) == key)
        else {
            eprintln!("no suite {key:?}");
            return Ok(ExitCode::from(2));
        };
        let modules = Modules::locate_and_compile()?;
        let suites = run_setups(&modules, vec![s])?;
        print!("{}", markdown(&suites));
        return Ok(ExitCode::SUCCESS);
    }
    if !["--print", "--check", "--write-budgets", "--json", "--fleet"].contains(&mode.as_str()) {
        eprintln!(
            "usage: computeflux-cost [--print | --check | --write-budgets | --json | --fleet | --suite KEY]"
        );
        return Ok(ExitCode::from(2));
    }
    if mode == "--fleet" {
        let started = std::time::Instant::now();
        let modules = Modules::locate_and_compile()?;
        let base_setups = computeflux_cost::setups()
            .into_iter()
            .filter(|(m, _, v)| *m == Module::Filter && v.is_empty())
            .collect();
        let base = run_setups(&modules, base_setups)?;
        let fleet = run_setups(&modules, computeflux_cost::fleet_setups())?;
        let departures = computeflux_cost::fleet::departures(modules.filter(), 1_000, 1)?;
        print!(
            "{}",
            computeflux_cost::fleet::markdown(&base, &fleet, Some(&departures))
        );
        eprintln!(
            "computeflux-cost: fleet report in {:.1} s",
            started.elapsed().as_secs_f64()
        );
        return Ok(ExitCode::SUCCESS);
    }
    let started = std::time::Instant::now();
    let modules = Modules::locate_and_compile()?;
    let compiled = started.elapsed();
    let suites = run_all(&modules)?;
    eprintln!(
        "computeflux-cost: modules built/located and compiled in {:.1} s, suites run in {:.1} s",
        compiled.as_secs_f64(),
        (started.elapsed() - compiled).as_secs_f64()
    );
    let counts = instruction_counts(&suites);
    let path = computeflux_cost::budgets_path();
    match mode.as_str() {
        "--print" => print!("{}", markdown(&suites)),
        "--json" => println!("{}", serde_json::to_string_pretty(&counts)?),
        "--write-budgets" => {
            let margin = Budgets::load(&path)
                .map(|b| b.margin_percent)
                .unwrap_or(5.0);
            std::fs::write(&path, Budgets::render(margin, &counts))?;
            eprintln!(
                "wrote {} ({} counts, margin {margin}%)",
                path.display(),
                counts.len()
            );
        }
        _ => {
            print!("{}", markdown(&suites));
            let (problems, notes) = Budgets::load(&path)?.check(&counts);
            for n in &notes {
                eprintln!("note: {n}");
            }
            if !problems.is_empty() {
                for p in &problems {
                    eprintln!("over budget: {p}");
                }
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
