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

/// The secrets config/webhooks.toml reads, by variable; set on the child only.
const WEBHOOK_SECRETS: [(&str, &str); 6] = [
    ("GITHUB_WEBHOOK_SECRET", "gh-s3cr3t-cli"),
    ("STRIPE_WEBHOOK_SECRET", "whsec_s3cr3t-cli"),
    ("SHOPIFY_WEBHOOK_SECRET", "shpss_s3cr3t-cli"),
    (
        "STANDARD_WEBHOOKS_SECRET",
        "whsec_czNjcjN0LWNsaS1zdGFuZGFyZC13ZWJob29rcw==",
    ),
    ("SLACK_SIGNING_SECRET", "slack-s3cr3t-cli"),
    ("TWILIO_AUTH_TOKEN", "twilio-s3cr3t-cli"),
];

/// `run` with none of config/webhooks.toml's secret variables inherited, then `env`.
fn run_webhooks(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = gateway_command();
    for (name, _) in WEBHOOK_SECRETS {
        cmd.env_remove(name);
    }
    cmd.args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run idemgate")
}

#[test]
fn shipped_configs_pass_check_config() {
    let out = run(
        &["--check-config", "--config", &sample("idemgate.toml")],
        &[],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("ok"), "{}", stdout(&out));

    // The webhook routes read their secrets from the environment.
    let webhooks = sample("webhooks.toml");
    let check = ["--check-config", "--config", webhooks.as_str()];
    let out = run_webhooks(&check, &WEBHOOK_SECRETS);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with("ok"), "{}", stdout(&out));
    assert!(stdout(&out).contains("6 route(s)"), "{}", stdout(&out));
    // Without them it is refused, naming the route's field and the first variable missing;
    // with one missing, that one.
    let out = run_webhooks(&check, &[]);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("routes[0].secret_env") && err.contains("GITHUB_WEBHOOK_SECRET"),
        "{err}"
    );
    let without_slack: Vec<_> = WEBHOOK_SECRETS
        .into_iter()
        .filter(|(name, _)| *name != "SLACK_SIGNING_SECRET")
        .collect();
    let out = run_webhooks(&check, &without_slack);
    assert_eq!(out.status.code(), Some(2), "{}", stdout(&out));
    let err = stderr(&out);
    assert!(
        err.contains("routes[4].secret_env")
            && err.contains("SLACK_SIGNING_SECRET")
            && err.contains("not set"),
        "{err}"
    );
    // An empty variable, and a Standard Webhooks secret that is not base64, are refused too;
    // and neither output ever shows a secret.
    let mut broken = WEBHOOK_SECRETS.to_vec();
    broken[0].1 = "";
    let out = run_webhooks(&check, &broken);
    assert!(
        stderr(&out).contains("GITHUB_WEBHOOK_SECRET is empty"),
        "{}",
        stderr(&out)
    );
    let mut broken = WEBHOOK_SECRETS.to_vec();
    broken[3].1 = "whsec_s3cr3t*not*base64";
    let out = run_webhooks(&check, &broken);
    let err = stderr(&out);
    assert!(
        err.contains("routes[3].secret_env")
            && err.contains("STANDARD_WEBHOOKS_SECRET")
            && err.contains("base64"),
        "{err}"
    );
    for out in [
        run_webhooks(&check, &WEBHOOK_SECRETS),
        run_webhooks(&check, &without_slack),
        run_webhooks(&check, &broken),
    ] {
        let all = format!("{}{}", stdout(&out), stderr(&out));
        assert!(!all.contains("s3cr3t"), "a secret was printed: {all}");
    }
}

#[test]
fn provider_route_mistakes_exit_non_zero_naming_the_field() {
    let dir = TempDir::new();
    let route = "upstream = \"http://127.0.0.1:3000\"\n[[routes]]\nprefix = \"/hooks\"\n";
    let env = [("HOOK_SECRET", "s3cr3t-hook")];
    let cases = [
        (
            "provider = \"gitlab\"\nsecret_env = \"HOOK_SECRET\"",
            "routes[0].provider",
            "\"standard-webhooks\"",
        ),
        ("provider = \"github\"", "routes[0].secret_env", "required"),
        (
            "provider = \"twilio\"\nsecret_env = \"HOOK_SECRET\"",
            "routes[0].public_url",
            "required",
        ),
        (
            "provider = \"stripe\"\nsecret_env = [\"HOOK_SECRET\", \"IDEMGATE_TEST_SURELY_UNSET\"]",
            "routes[0].secret_env",
            "IDEMGATE_TEST_SURELY_UNSET",
        ),
        (
            "provider = \"slack\"\nsecret_env = \"HOOK_SECRET\"\nsignature_tolerance = \"later\"",
            "routes[0].signature_tolerance",
            "not a duration",
        ),
    ];
    for (lines, field, hint) in cases {
        let path = dir.write("idemgate.toml", &format!("{route}{lines}"));
        let path = path.to_str().unwrap();
        for args in [
            vec!["--check-config", "--config", path],
            vec!["--config", path, "--listen", "127.0.0.1:0"],
        ] {
            let out = run(&args, &env);
            assert_eq!(out.status.code(), Some(2), "{lines:?} was accepted");
            let err = stderr(&out);
            assert!(
                err.contains(field) && err.contains(hint),
                "for {lines:?} expected {field:?} and {hint:?} in: {err}"
            );
            assert!(!err.contains("s3cr3t"), "a secret was printed: {err}");
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
