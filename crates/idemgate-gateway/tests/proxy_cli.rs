//! The `idemgate` command line: `--check-config`, refused configs, precedence of flags over
//! environment over file, and the shipped sample configs.

#[path = "support/proxy.rs"]
mod support;

use std::process::Output;

use support::{TempDir, gateway_command};

fn run(args: &[&str], env: &[(&str, &str)]) -> Output {
    gateway_command()
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run idemgate")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn sample(name: &str) -> String {
    format!("{}/../../config/{name}", env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn shipped_configs_pass_check_config() {
    for name in ["idemgate.toml", "webhooks.toml"] {
        let out = run(&["--check-config", "--config", &sample(name)], &[]);
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        assert!(stdout(&out).starts_with("ok"), "{name}: {}", stdout(&out));
        if name == "webhooks.toml" {
            assert!(stdout(&out).contains("4 route(s)"), "{}", stdout(&out));
        }
    }
}

/// The parser's message comes once, after the file's name, not again as its own cause.
#[test]
fn a_config_that_does_not_parse_is_told_once() {
    let dir = TempDir::new();
    let path = dir.write(
        "idemgate.toml",
        "upstream = \"http://127.0.0.1:3000\"\nlissten = 1\n",
    );
    let out = run(&["--check-config", "--config", path.to_str().unwrap()], &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("config file "), "{err}");
    assert_eq!(err.matches("unknown field `lissten`").count(), 1, "{err}");
}

#[test]
fn bad_configs_exit_non_zero_naming_the_field() {
    let dir = TempDir::new();
    let up = "upstream = \"http://127.0.0.1:3000\"\n";
    let cases = [
        (format!("{up}ttl = \"forever\""), "ttl", "not a duration"),
        (
            format!("{up}lissten = \"127.0.0.1:1\""),
            "lissten",
            "unknown field",
        ),
        (
            "upstream = \"https://api.example\"".to_owned(),
            "upstream",
            "https",
        ),
        (
            "upstream = \"http://deploy:hunter2@127.0.0.1:3000\"".to_owned(),
            "upstream",
            "credentials",
        ),
        (format!("{up}store = \"sqlite:x\""), "store", "redb:PATH"),
        (
            format!("{up}[[routes]]\nprefix = \"/a\"\npreset = \"quick\""),
            "routes[0].preset",
            "webhook",
        ),
        (
            format!("{up}[[routes]]\nprefix = \"/a\"\nstore_statuses = [\"2xx\", \"7xx\"]"),
            "routes[0].store_statuses",
            "7xx",
        ),
        (
            format!("{up}[limits]\nmax_connections = 0"),
            "limits.max_connections",
            "1 to",
        ),
        (
            "listen = \"127.0.0.1:8080\"".to_owned(),
            "upstream",
            "required",
        ),
        (
            format!(
                "{up}upstream_timeout = \"1s\"\n[[routes]]\nprefix = \"/a\"\nconcurrent = \"sometimes\""
            ),
            "routes[0].concurrent",
            "`wait`",
        ),
        ("this is not toml".to_owned(), "idemgate.toml", "expected"),
    ];
    for (text, field, hint) in cases {
        let path = dir.write("idemgate.toml", &text);
        let path = path.to_str().unwrap();
        for args in [
            vec!["--check-config", "--config", path],
            vec!["--config", path, "--listen", "127.0.0.1:0"],
        ] {
            let out = run(&args, &[]);
            assert!(!out.status.success(), "{text:?} was accepted");
            let err = stderr(&out);
            assert!(
                err.contains(field) && err.contains(hint),
                "for {text:?} expected {field:?} and {hint:?} in: {err}"
            );
            assert!(!err.contains("hunter2"), "a password was echoed: {err}");
        }
    }
    let out = run(
        &["--check-config", "--config", "/nonexistent/idemgate.toml"],
        &[],
    );
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/nonexistent/idemgate.toml"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn flags_win_over_environment_which_wins_over_the_file() {
    let dir = TempDir::new();
    let path = dir.write(
        "idemgate.toml",
        "upstream = \"http://127.0.0.1:1001\"\nstore = \"memory\"\n",
    );
    let path = path.to_str().unwrap();
    let file_only = run(&["--check-config", "--config", path], &[]);
    assert!(
        stdout(&file_only).contains("127.0.0.1:1001"),
        "{}",
        stdout(&file_only)
    );

    let env = [
        ("IDEMGATE_UPSTREAM", "http://127.0.0.1:1002"),
        ("IDEMGATE_STORE", "redb:/tmp/x.redb"),
    ];
    let with_env = run(&["--check-config", "--config", path], &env);
    assert!(
        stdout(&with_env).contains("127.0.0.1:1002"),
        "{}",
        stdout(&with_env)
    );
    assert!(
        stdout(&with_env).contains("redb:/tmp/x.redb"),
        "{}",
        stdout(&with_env)
    );

    let with_flag = run(
        &[
            "--check-config",
            "--config",
            path,
            "--upstream",
            "http://127.0.0.1:1003",
        ],
        &env,
    );
    assert!(
        stdout(&with_flag).contains("127.0.0.1:1003"),
        "{}",
        stdout(&with_flag)
    );

    // The config file itself can come from the environment.
    let env_config = run(&["--check-config"], &[("IDEMGATE_CONFIG", path)]);
    assert!(
        stdout(&env_config).contains("127.0.0.1:1001"),
        "{}",
        stdout(&env_config)
    );

    // A bad value from the environment is refused and named too.
    let bad_env = run(
        &["--check-config", "--config", path],
        &[("IDEMGATE_TTL", "soon")],
    );
    assert!(!bad_env.status.success());
    assert!(stderr(&bad_env).contains("ttl"), "{}", stderr(&bad_env));
    // The flag and the variable read durations as the file does, parts and spaces included.
    let spaced = run(
        &["--check-config", "--config", path, "--ttl", "1h 30m"],
        &[],
    );
    assert!(spaced.status.success(), "{}", stderr(&spaced));
}

#[test]
fn runs_with_no_config_file() {
    let out = run(
        &["--check-config", "--upstream", "http://127.0.0.1:3000"],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("redb:./data/idemgate.redb"),
        "the default store is the embedded file: {}",
        stdout(&out)
    );
}
