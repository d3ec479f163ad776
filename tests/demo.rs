//! The README's first command: `switchboard demo` runs the whole loop on a
//! temporary store and exits 0, reporting the duplicate as a duplicate.

#[test]
fn the_demo_runs_the_whole_loop_and_exits_zero() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_switchboard"))
        .arg("demo")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "demo failed:\n{stdout}\n{stderr}");
    for step in [
        "stored", "dedup", "admitted", "answered", "acked", "RECEIVE",
    ] {
        assert!(
            stdout.contains(step),
            "the demo did not show the {step:?} step:\n{stdout}"
        );
    }
    assert!(stdout.contains("\"status\":\"duplicate\""), "{stdout}");
    assert!(stdout.contains("reported as duplicate:   1"), "{stdout}");
    assert!(
        stdout.contains("replies received:        5 (5 distinct reply keys)"),
        "{stdout}"
    );
    assert!(stdout.contains("totals: acknowledged: 5"), "{stdout}");
}
