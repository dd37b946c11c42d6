//! Prometheus' own checker, shared by the test binaries that read `/metrics`.

use std::io::Write as _;
use std::process::{Command, Stdio};

/// Asserts that `promtool check metrics` (from Debian's `prometheus` package, which
/// `.ci/install-deps` installs) parses `exposition` and finds nothing to lint.
pub(crate) fn accepts(exposition: &str) {
    let mut promtool = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("promtool is not installed: run .ci/install-deps");
    let mut stdin = promtool.stdin.take().expect("piped stdin");
    stdin.write_all(exposition.as_bytes()).unwrap();
    drop(stdin);
    let output = promtool.wait_with_output().unwrap();
    let said = String::from_utf8_lossy(&output.stdout) + String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && said.trim().is_empty(),
        "promtool check metrics: {:?}\n{said}\n{exposition}",
        output.status
    );
}
