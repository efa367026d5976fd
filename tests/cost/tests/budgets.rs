//! The budgets gate: every scenario's instruction count within `budgets.json`'s margin, and
//! the counts the same on a second run (the harness is deterministic or it is useless).

use computeflux_cost::{instruction_counts, markdown, run_all, Budgets, Modules};

#[test]
fn instructions_within_budgets_and_deterministic() {
    let modules = Modules::locate_and_compile().expect("wasm modules");
    let first = run_all(&modules).expect("first run");
    println!("{}", markdown(&first));
    let second = run_all(&modules).expect("second run (fresh VMs)");
    assert_eq!(
        first, second,
        "two runs of the same modules gave different counts"
    );
    let counts = instruction_counts(&first);
    let budgets = Budgets::load(&computeflux_cost::budgets_path()).expect("budgets.json");
    let (problems, notes) = budgets.check(&counts);
    for n in &notes {
        println!("note: {n}");
    }
    assert!(
        problems.is_empty(),
        "instruction budgets exceeded (margin {}%):\n{}\nIf the increase is intended, regenerate: cargo run -p computeflux-cost -- --write-budgets",
        budgets.margin_percent,
        problems.join("\n")
    );
}

#[test]
fn a_regression_above_the_margin_fails() {
    let mut counts = std::collections::BTreeMap::new();
    counts.insert("filter/4/new_session".to_string(), 1000u64);
    let budgets = Budgets {
        margin_percent: 5.0,
        instructions: counts.clone(),
    };
    assert!(budgets.check(&counts).0.is_empty());
    counts.insert("filter/4/new_session".to_string(), 1050);
    assert!(
        budgets.check(&counts).0.is_empty(),
        "exactly at the margin passes"
    );
    counts.insert("filter/4/new_session".to_string(), 1051);
    assert_eq!(budgets.check(&counts).0.len(), 1);
}
