//! Packages on demand against real R (issue 28): small source packages
//! built with `R CMD build` into a CRAN-like repository written by
//! `tools::write_PACKAGES`, served as `file://` and by a loopback HTTP
//! server; installed into tenant libraries with `rvisor-packages` and
//! loaded in confined sessions.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;

use rvisor::{SessionOptions, Supervisor, SupervisorConfig};
use rvisor_ffi_tests::TestDir;
use rvisor_packages::{Installed, Installer, PackageError, Policy, RInfo, Repository};

fn write(dir: &Path, files: &[(&str, &str)]) {
    for (name, body) in files {
        let p = dir.join(name);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, body).unwrap();
    }
}

fn description(name: &str, extra: &str) -> String {
    format!(
        "Package: {name}\nVersion: 1.0\nTitle: Test Package\nDescription: A package of rvisor's tests.\nAuthor: rvisor\nMaintainer: rvisor <rvisor@example.org>\nLicense: MIT\n{extra}"
    )
}

/// Writes the sources of the test packages under `src`.
fn sources(src: &Path, port: u16) {
    let pkg = |name: &str, extra: &str, files: &[(&str, &str)]| {
        let d = src.join(name);
        write(&d, &[("DESCRIPTION", &description(name, extra))]);
        write(&d, files);
    };
    pkg(
        "rvbase",
        "",
        &[
            ("NAMESPACE", "export(base_hello)\n"),
            (
                "R/base.R",
                "base_hello <- function() \"hello from rvbase\"\n",
            ),
        ],
    );
    pkg(
        "rvuses",
        "Imports: rvbase\n",
        &[
            (
                "NAMESPACE",
                "importFrom(rvbase, base_hello)\nexport(uses_hello)\n",
            ),
            (
                "R/uses.R",
                "uses_hello <- function() paste(\"rvuses and\", base_hello())\n",
            ),
        ],
    );
    pkg(
        "rvcode",
        "",
        &[
            ("NAMESPACE", "useDynLib(rvcode)\nexport(rv_add)\n"),
            ("R/add.R", "rv_add <- function(a, b) .Call(\"rv_add\", as.numeric(a), as.numeric(b), PACKAGE = \"rvcode\")\n"),
            (
                "src/add.c",
                "#include <R.h>\n#include <Rinternals.h>\nSEXP rv_add(SEXP a, SEXP b) { return Rf_ScalarReal(REAL(a)[0] + REAL(b)[0]); }\n",
            ),
        ],
    );
    pkg(
        "rvbroken",
        "",
        &[
            ("NAMESPACE", "export(nothing)\n"),
            (
                "R/bad.R",
                "stop(\"rvbroken refuses to build\")\nnothing <- function() NULL\n",
            ),
        ],
    );
    pkg(
        "rvtamper",
        "",
        &[
            ("NAMESPACE", "export(tampered)\n"),
            ("R/t.R", "tampered <- function() \"original\"\n"),
        ],
    );
    // Build-time code that reaches for the network (the test's own
    // loopback server) and one that never ends.
    let net = format!(
        "con <- socketConnection('127.0.0.1', {port}, blocking = TRUE, timeout = 5)\nclose(con)\nreached <- TRUE\n"
    );
    pkg("rvnetwork", "", &[("NAMESPACE", "\n"), ("R/net.R", &net)]);
    pkg(
        "rvloop",
        "",
        &[("NAMESPACE", "\n"), ("R/loop.R", "repeat {}\n")],
    );
    // Build-time code that reads and writes outside its build: a file of
    // the host beside the repository, another tenant's library (bob's,
    // under the test's state directory), the host's /tmp. It records
    // what it could do rather than failing, so a session can ask.
    let root = src
        .parent()
        .expect("src has a parent")
        .display()
        .to_string();
    let snoop = format!(
        r#"probe <- function(expr) tryCatch({{ expr; "done" }}, error = function(e) "denied", warning = function(w) "denied")
seen_at_build <- c(
  host = probe(readLines("{root}/host-secret")),
  tenant = probe(readLines("{root}/state/tenants/626f62/library/rvbase/DESCRIPTION")),
  planted = probe(writeLines("x", "{root}/planted-by-build")),
  tmp = probe(writeLines("x", "/tmp/rvisor-rvsnoop-planted"))
)
seen <- function() seen_at_build
"#
    );
    pkg(
        "rvsnoop",
        "",
        &[("NAMESPACE", "export(seen)\n"), ("R/snoop.R", &snoop)],
    );
    pkg(
        "rvcycleone",
        "Imports: rvcycletwo\n",
        &[("NAMESPACE", "\n"), ("R/a.R", "a <- 1\n")],
    );
    pkg(
        "rvcycletwo",
        "Imports: rvcycleone\n",
        &[("NAMESPACE", "\n"), ("R/b.R", "b <- 1\n")],
    );
}

fn r(dir: &Path, args: &[&str]) {
    let out = Command::new("R")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("R runs");
    assert!(
        out.status.success(),
        "R {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A CRAN-like repository in `root`: every test package built, the index
/// written, then rvtamper's tarball replaced by another build so it no
/// longer matches the index's MD5sum.
fn repository(root: &Path, port: u16) -> PathBuf {
    let src = root.join("src-pkgs");
    sources(&src, port);
    let contrib = root.join("repo/src/contrib");
    std::fs::create_dir_all(&contrib).unwrap();
    let names = [
        "rvbase",
        "rvuses",
        "rvcode",
        "rvbroken",
        "rvtamper",
        "rvcycleone",
        "rvcycletwo",
        "rvnetwork",
        "rvloop",
        "rvsnoop",
    ];
    let mut args = vec![
        "CMD".to_string(),
        "build".into(),
        "--no-build-vignettes".into(),
        "--no-manual".into(),
    ];
    args.extend(names.iter().map(|n| src.join(n).display().to_string()));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    r(&contrib, &args);
    // A hostile tarball made by hand: a symbolic link out of its tree.
    let evil = root.join("evil/rvevil");
    write(
        &evil,
        &[
            ("DESCRIPTION", &description("rvevil", "")),
            ("NAMESPACE", "\n"),
        ],
    );
    std::os::unix::fs::symlink("../../../../etc", evil.join("escape")).unwrap();
    let st = Command::new("tar")
        .arg("-czf")
        .arg(contrib.join("rvevil_1.0.tar.gz"))
        .arg("-C")
        .arg(root.join("evil"))
        .arg("rvevil")
        .status()
        .unwrap();
    assert!(st.success());
    r(
        &contrib,
        &[
            "--vanilla",
            "-s",
            "-e",
            "tools::write_PACKAGES('.', type = 'source')",
        ],
    );
    write(
        &src.join("rvtamper"),
        &[(
            "R/t.R",
            "tampered <- function() \"changed after the index\"\n",
        )],
    );
    r(
        &contrib,
        &[
            "CMD",
            "build",
            "--no-manual",
            &src.join("rvtamper").display().to_string(),
        ],
    );
    root.join("repo")
}

/// Serves `root`'s files on loopback until the test process ends.
fn serve(root: PathBuf) -> String {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    std::thread::spawn(move || {
        for stream in l.incoming().flatten() {
            let mut s = stream;
            let mut line = String::new();
            let mut rd = BufReader::new(s.try_clone().unwrap());
            if rd.read_line(&mut line).is_err() {
                continue;
            }
            loop {
                let mut h = String::new();
                if rd.read_line(&mut h).map(|n| n == 0).unwrap_or(true) || h == "\r\n" {
                    break;
                }
            }
            let path = line.split_whitespace().nth(1).unwrap_or("/").to_string();
            let file = root.join(path.trim_start_matches('/'));
            let resp = match (path.contains(".."), std::fs::read(&file)) {
                (false, Ok(body)) => {
                    let mut r = format!(
                        "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                        body.len()
                    )
                    .into_bytes();
                    r.extend(body);
                    r
                }
                _ => b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                    .to_vec(),
            };
            let _ = s.write_all(&resp);
        }
    });
    format!("http://{addr}")
}

fn installer(state: &Path, repo: &str, policy: impl FnOnce(&mut Policy)) -> Installer {
    let mut p = Policy {
        repositories: vec![Repository::parse(repo).unwrap()],
        ..Policy::default()
    };
    policy(&mut p);
    let rinfo = RInfo::probe(Path::new("R"), &[]).expect("R answers");
    Installer::new(p, state.to_path_buf(), rinfo)
}

fn names(v: &[Installed]) -> Vec<(&str, bool)> {
    v.iter().map(|i| (i.name.as_str(), i.cached)).collect()
}

/// The package directories of a library (empty when it does not exist).
fn listing(lib: &Path) -> BTreeSet<String> {
    std::fs::read_dir(lib)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// A confined session of `sup` with `lib` after R's own libraries, as
/// a tenant's sessions have their tenant library.
fn session_with(sup: &Supervisor, lib: &Path) -> rvisor::Session {
    // Confined workers run as other uids: let them read the library.
    let _ = Command::new("chmod").args(["-R", "a+rX"]).arg(lib).status();
    sup.session_with(SessionOptions {
        libpath_after: vec![lib.to_path_buf()],
        ..SessionOptions::default()
    })
    .expect("session")
}

fn console(s: &rvisor::Session, code: &str) -> rvisor::RunResult {
    s.run(code).expect("queued").wait()
}

#[test]
fn a_tenant_installs_with_dependencies_sessions_load_it_and_another_tenant_gets_the_cached_build() {
    let dir = TestDir::new("pkgs-file");
    let repo = repository(dir.path(), 9);
    let inst = installer(
        &dir.path().join("state"),
        &format!("file://{}", repo.display()),
        |_| {},
    );

    let got = inst.install("alice", &["rvuses".into()]).expect("install");
    assert_eq!(
        names(&got),
        [("rvbase", false), ("rvuses", false)],
        "{got:?}"
    );
    assert!(got
        .iter()
        .all(|i| i.version == "1.0" && i.repository.starts_with("file://")));
    assert!(got[1].requested && !got[0].requested, "{got:?}");
    assert_eq!(inst.installed("alice").len(), 2);
    assert!(inst.installed("bob").is_empty());

    // Asked again: already there, nothing rebuilt.
    assert!(inst
        .install("alice", &["rvuses".into()])
        .unwrap()
        .is_empty());

    // Alice's session loads it, from after R's own libraries; bob's
    // session of the same supervisor does not see it.
    let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
    let s = session_with(&sup, &inst.library("alice"));
    let r = console(&s, "library(rvuses); cat(uses_hello())");
    assert_eq!(r.console, "rvuses and hello from rvbase", "{r:?}");
    let r = console(&s, "lp <- .libPaths(); cat(lp[length(lp)] == dirname(find.package('rvuses')), match(.Library, lp) < length(lp))");
    assert_eq!(
        r.console, "TRUE TRUE",
        "the tenant library comes last: {r:?}"
    );
    std::fs::create_dir_all(inst.library("bob")).unwrap();
    let b = session_with(&sup, &inst.library("bob"));
    let r = console(&b, "cat(requireNamespace('rvuses', quietly = TRUE))");
    assert_eq!(r.console, "FALSE", "{r:?}");

    // Bob's install of the same packages comes from the cache, and a new
    // session of the running supervisor loads them.
    let got = inst.install("bob", &["rvuses".into()]).expect("install");
    assert_eq!(names(&got), [("rvbase", true), ("rvuses", true)], "{got:?}");
    let b = session_with(&sup, &inst.library("bob"));
    let r = console(&b, "library(rvuses); cat(uses_hello())");
    assert_eq!(r.console, "rvuses and hello from rvbase", "{r:?}");
}

#[test]
fn a_build_reads_and_writes_nothing_outside_its_own_directory() {
    let dir = TestDir::new("pkgs-snoop");
    let repo = repository(dir.path(), 9);
    std::fs::write(dir.path().join("host-secret"), "the host's\n").unwrap();
    let _ = std::fs::remove_file("/tmp/rvisor-rvsnoop-planted");
    let inst = installer(
        &dir.path().join("state"),
        &format!("file://{}", repo.display()),
        |_| {},
    );
    inst.install("bob", &["rvbase".into()])
        .expect("bob's install");
    assert!(inst.library("bob").join("rvbase/DESCRIPTION").exists());
    inst.install("alice", &["rvsnoop".into()])
        .expect("a build that only looks around still installs");
    let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
    let s = session_with(&sup, &inst.library("alice"));
    let r = console(
        &s,
        "cat(paste(names(rvsnoop::seen()), rvsnoop::seen(), sep = '='))",
    );
    assert_eq!(
        r.console, "host=denied tenant=denied planted=denied tmp=denied",
        "the build saw: {r:?}"
    );
    assert!(!dir.path().join("planted-by-build").exists());
    assert!(!Path::new("/tmp/rvisor-rvsnoop-planted").exists());
}

#[test]
fn refusals_and_failures_name_their_rule_and_leave_the_library_unchanged() {
    let dir = TestDir::new("pkgs-http");
    let url = serve(dir.path().join("repo"));
    let port: u16 = url.rsplit(':').next().unwrap().parse().unwrap();
    repository(dir.path(), port);
    let state = dir.path().join("state");
    let inst = installer(&state, &url, |p| {
        p.deny.insert("rvcycletwo".into());
    });
    // Something in the library first, so "unchanged" means something.
    let got = inst.install("t", &["rvbase".into()]).expect("over HTTP");
    assert_eq!(names(&got), [("rvbase", false)]);
    assert!(got[0].repository.starts_with("http://127.0.0.1:"));
    let lib = inst.library("t");
    let before = listing(&lib);
    let manifest = inst.installed("t");

    let check = |pkg: &str, expect: &dyn Fn(&PackageError) -> bool| {
        let e = inst.install("t", &[pkg.into()]).expect_err(pkg);
        assert!(expect(&e), "{pkg}: {e}");
        assert_eq!(listing(&lib), before, "{pkg} changed the library");
        assert_eq!(inst.installed("t"), manifest);
        e.to_string()
    };
    // A denied dependency refuses the package that needs it.
    let m = check(
        "rvcycleone",
        &|e| matches!(e, PackageError::Refused { rule: "deny", package, .. } if package == "rvcycletwo"),
    );
    assert!(m.contains("rule 'deny'"), "{m}");
    let m = check("nosuchpkg", &|e| matches!(e, PackageError::Unknown { .. }));
    assert!(m.contains("not in any allowed repository"), "{m}");
    let m = check("rvtamper", &|e| {
        matches!(
            e,
            PackageError::Checksum {
                algorithm: "MD5sum",
                ..
            }
        )
    });
    assert!(m.contains("does not match the repository index"), "{m}");
    let m = check("rvbroken", &|e| matches!(e, PackageError::Build { .. }));
    assert!(
        m.contains("rvbroken refuses to build"),
        "the build's own error is shown: {m}"
    );
    let m = check("rvevil", &|e| matches!(e, PackageError::Tarball { .. }));
    assert!(m.contains("links out of the package's directory"), "{m}");
    check("../etc", &|e| {
        matches!(e, PackageError::Refused { rule: "name", .. })
    });

    // As root the builder has no network: the same connection from the
    // host works. (Without root it keeps the host's, as documented, and
    // the build goes through.)
    assert!(
        rvisor_packages::confine::BuilderSandbox::here().network,
        "these tests run as root, as the confined sessions need"
    );
    let m = check("rvnetwork", &|e| matches!(e, PackageError::Build { .. }));
    assert!(m.contains("cannot open the connection"), "{m}");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok(),
        "the host reaches the server"
    );
    // A build that never ends is stopped at the timeout.
    let quick = installer(&state, &url, |p| {
        p.build_timeout = std::time::Duration::from_secs(3)
    });
    let e = quick.install("t", &["rvloop".into()]).expect_err("loop");
    assert!(e.to_string().contains("longer than 3 s"), "{e}");
    assert_eq!(listing(&lib), before);

    // The cycle, with no deny-list in the way.
    let open = installer(&state, &url, |_| {});
    let e = open
        .install("t", &["rvcycleone".into()])
        .expect_err("cycle");
    assert!(
        matches!(&e, PackageError::Cycle { cycle } if cycle.len() == 3),
        "{e}"
    );
    // Compiled code: refused by the rule, built when allowed.
    let pure = installer(&state, &url, |p| p.compiled = false);
    let e = pure.install("t", &["rvcode".into()]).expect_err("compiled");
    assert!(
        matches!(
            e,
            PackageError::Refused {
                rule: "compiled",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(listing(&lib), before);
    // A library cap smaller than the build.
    let small = installer(&state, &url, |p| p.max_library_bytes = 1);
    let e = small.install("t", &["rvcode".into()]).expect_err("cap");
    assert!(
        matches!(
            e,
            PackageError::Refused {
                rule: "library_bytes",
                ..
            }
        ),
        "{e}"
    );
    assert_eq!(listing(&lib), before);

    let got = open
        .install("t", &["rvcode".into()])
        .expect("C code builds");
    assert_eq!(
        names(&got),
        [("rvcode", true)],
        "the capped attempt built and cached it: {got:?}"
    );
    let sup = Supervisor::new(SupervisorConfig::default()).expect("supervisor starts");
    let s = session_with(&sup, &lib);
    let r = console(&s, "cat(rvcode::rv_add(2, 40))");
    assert_eq!(r.console, "42", "{r:?}");
}

/// A `rvisor serve` (confined workers, tenants alice and bob) installing
/// from `repo` into `packages`.
fn server(dir: &Path, repo: &str, packages: &Path) -> rvisor_ffi_tests::ServeBin {
    let tokens = dir.join("tokens");
    std::fs::write(
        &tokens,
        "alice-token-0123456789 alice\nbob-token-0123456789ab bob\ncarol-token-0123456789 carol\n",
    )
    .unwrap();
    rvisor_ffi_tests::ServeBin::start_with(rvisor_ffi_tests::ServeOptions {
        tokens: Some(&tokens),
        args: &[
            "--package-repo",
            repo,
            "--package-deny",
            "rvcycletwo",
            "--package-dir",
            &packages.display().to_string(),
        ],
        confined: true,
        ..Default::default()
    })
}

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-0123456789ab";
const CAROL: &str = "carol-token-0123456789";

fn http(
    srv: &rvisor_ffi_tests::ServeBin,
    method: &str,
    path: &str,
    token: &str,
    body: Option<serde_json::Value>,
) -> (u16, serde_json::Value) {
    let url = format!("http://{}{path}", srv.addr);
    let a = rvisor_ffi_tests::cluster::call(
        method,
        &url,
        token,
        body.map(|b| ("application/json", b.to_string().into_bytes())),
    );
    (a.status, a.body)
}

fn run_as(srv: &rvisor_ffi_tests::ServeBin, token: &str, code: &str) -> serde_json::Value {
    let (status, r) = http(
        srv,
        "POST",
        "/v1/run",
        token,
        Some(serde_json::json!({"script": code, "timeout_seconds": 60})),
    );
    assert_eq!(status, 200, "{r}");
    r
}

#[test]
fn over_http_a_tenant_installs_from_outside_and_from_r_code_and_its_library_survives_a_restart() {
    let dir = TestDir::new("pkgs-serve");
    let repo = repository(dir.path(), 9);
    let repo_url = format!("file://{}", repo.display());
    let packages = dir.path().join("packages");
    let srv = server(dir.path(), &repo_url, &packages);

    // Health and /v1/packages show the policy.
    let (_, h) = http(&srv, "GET", "/v1/health", ALICE, None);
    assert_eq!(
        h["package_install"]["repositories"][0]["url"], repo_url,
        "{h}"
    );
    assert_eq!(h["package_install"]["deny"][0], "rvcycletwo", "{h}");
    let (status, p) = http(&srv, "GET", "/v1/packages", ALICE, None);
    assert_eq!(status, 200, "{p}");
    assert!(p["packages"]
        .as_array()
        .unwrap()
        .iter()
        .any(|x| x["name"] == "stats"));
    assert_eq!(p["tenant_packages"], serde_json::json!([]));
    assert_eq!(p["install"]["compiled"], true);

    // From outside: alice installs rvuses (and rvbase with it).
    let (status, got) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        ALICE,
        Some(serde_json::json!({"packages": ["rvuses"]})),
    );
    assert_eq!(status, 200, "{got}");
    let names: Vec<&str> = got["installed"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| i["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["rvbase", "rvuses"], "{got}");
    let r = run_as(&srv, ALICE, "library(rvuses); cat(uses_hello())");
    assert_eq!(r["console"], "rvuses and hello from rvbase", "{r}");
    // The result says which tenant packages it had loaded, from where.
    let loaded: Vec<(&str, &str, &str)> = r["packages_loaded"]
        .as_array()
        .unwrap_or_else(|| panic!("packages_loaded: {r}"))
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap(),
                p["version"].as_str().unwrap(),
                p["repository"].as_str().unwrap_or(""),
            )
        })
        .collect();
    assert_eq!(
        loaded,
        [
            ("rvbase", "1.0", repo_url.as_str()),
            ("rvuses", "1.0", repo_url.as_str())
        ],
        "{r}"
    );
    let r = run_as(&srv, ALICE, "1 + 1");
    assert!(r.get("packages_loaded").is_none(), "none loaded: {r}");

    // Alice's library as a lockfile, made again for carol: exactly those
    // versions, checked against the tarballs' SHA-256.
    let (status, lock) = http(&srv, "GET", "/v1/packages/lockfile", ALICE, None);
    assert_eq!(status, 200, "{lock}");
    let locked: Vec<&str> = lock["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["name"].as_str().unwrap())
        .collect();
    assert_eq!(locked, ["rvbase", "rvuses"], "dependencies first: {lock}");
    assert_eq!(
        lock["packages"][0]["sha256"].as_str().map(str::len),
        Some(64),
        "{lock}"
    );
    let mut wrong = lock.clone();
    wrong["packages"][1]["sha256"] = serde_json::json!("00".repeat(32));
    let (status, e) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        CAROL,
        Some(serde_json::json!({"lockfile": wrong})),
    );
    assert_eq!(
        (status, &e["error"]["details"]["reason"]),
        (422, &serde_json::json!("checksum")),
        "{e}"
    );
    let mut old_version = lock.clone();
    old_version["packages"][0]["version"] = serde_json::json!("0.9");
    let (_, e) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        CAROL,
        Some(serde_json::json!({"lockfile": old_version})),
    );
    assert_eq!(e["error"]["details"]["rule"], "lockfile", "{e}");
    assert!(
        e["error"]["message"].as_str().unwrap().contains("snapshot"),
        "{e}"
    );
    let (_, p) = http(&srv, "GET", "/v1/packages", CAROL, None);
    assert_eq!(
        p["tenant_packages"],
        serde_json::json!([]),
        "nothing half done: {p}"
    );
    let (status, got) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        CAROL,
        Some(serde_json::json!({"lockfile": lock})),
    );
    assert_eq!(status, 200, "{got}");
    assert_eq!(got["installed"].as_array().unwrap().len(), 2, "{got}");
    let r = run_as(&srv, CAROL, "library(rvuses); cat(uses_hello())");
    assert_eq!(r["console"], "rvuses and hello from rvbase", "{r}");
    let (status, e) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        CAROL,
        Some(serde_json::json!({"packages": ["rvbase"], "lockfile": lock})),
    );
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (422, Some("invalid")),
        "{e}"
    );
    // Bob's runs do not see it.
    let r = run_as(&srv, BOB, "cat(requireNamespace('rvuses', quietly = TRUE))");
    assert_eq!(r["console"], "FALSE", "{r}");

    // From R code in bob's session: install.packages() goes through the
    // host (the confined worker has no network and a read-only library),
    // says what it did, and the session loads it at once.
    let (status, s) = http(
        &srv,
        "POST",
        "/v1/sessions",
        BOB,
        Some(serde_json::json!({})),
    );
    assert_eq!(status, 201, "{s}");
    let sid = s["id"].as_str().unwrap().to_string();
    let srun = |code: &str| {
        let (status, r) = http(
            &srv,
            "POST",
            &format!("/v1/sessions/{sid}/run"),
            BOB,
            Some(serde_json::json!({"code": code, "timeout_seconds": 60})),
        );
        assert_eq!(status, 200, "{r}");
        r
    };
    let r = srun("x <- 41; install.packages('rvuses'); library(rvuses); cat(uses_hello())");
    assert_eq!(r["success"], true, "{r}");
    let console = r["console"].as_str().unwrap();
    assert!(
        console.contains("installed rvuses 1.0") && console.contains("from the cache"),
        "alice's builds are reused: {console}"
    );
    assert!(
        console.ends_with("rvuses and hello from rvbase"),
        "{console}"
    );
    // A refusal names the rule and the session goes on with its state.
    let r = srun("install.packages('rvcycleone')");
    assert_eq!(r["success"], false, "{r}");
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(
        msg.contains("rule 'deny'") && msg.contains("rvcycletwo"),
        "{msg}"
    );
    let r = srun("install.packages('rvbroken')");
    let msg = r["error"]["message"].as_str().unwrap();
    assert!(msg.contains("failed to build"), "{msg}");
    let r = srun("cat(x + 1)");
    assert_eq!(r["console"], "42", "{r}");
    // A file or URL is not installed.
    let r = srun("install.packages('/tmp/x_1.0.tar.gz', repos = NULL)");
    assert!(
        r["error"]["message"].as_str().unwrap().contains("by name"),
        "{r}"
    );

    // Errors from outside: the step in details, the library unchanged.
    let (status, e) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        ALICE,
        Some(serde_json::json!({"packages": ["nosuchpkg"]})),
    );
    assert_eq!(status, 422, "{e}");
    assert_eq!(e["error"]["code"], "package", "{e}");
    assert_eq!(e["error"]["details"]["reason"], "unknown_package", "{e}");
    let (status, e) = http(
        &srv,
        "POST",
        "/v1/packages/install",
        ALICE,
        Some(serde_json::json!({"packages": []})),
    );
    assert_eq!(
        (status, e["error"]["code"].as_str()),
        (422, Some("invalid")),
        "{e}"
    );
    let (_, p) = http(&srv, "GET", "/v1/packages", ALICE, None);
    assert_eq!(p["tenant_packages"].as_array().unwrap().len(), 2, "{p}");

    // A restart keeps both tenants' libraries.
    drop(srv);
    let srv = server(dir.path(), &repo_url, &packages);
    let r = run_as(&srv, ALICE, "library(rvuses); cat(uses_hello())");
    assert_eq!(r["console"], "rvuses and hello from rvbase", "{r}");
    let (_, p) = http(&srv, "GET", "/v1/packages", BOB, None);
    let bob: Vec<(&str, bool)> = p["tenant_packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["name"].as_str().unwrap(), i["cached"].as_bool().unwrap()))
        .collect();
    assert_eq!(bob, [("rvbase", true), ("rvuses", true)], "{p}");
}

/// One JSON-RPC request to an `rvisor mcp` child, its answer.
fn mcp_request(
    stdin: &mut std::process::ChildStdin,
    stdout: &mut BufReader<std::process::ChildStdout>,
    id: u64,
    method: &str,
    params: serde_json::Value,
) -> serde_json::Value {
    let msg = serde_json::json!({"jsonrpc": "2.0", "id": id, "method": method, "params": params});
    writeln!(stdin, "{msg}").unwrap();
    stdin.flush().unwrap();
    let mut line = String::new();
    assert!(stdout.read_line(&mut line).unwrap() > 0, "rvisor mcp ended");
    let r: serde_json::Value = serde_json::from_str(&line).unwrap();
    assert_eq!(r["id"], id, "{r}");
    r
}

#[test]
fn over_mcp_install_r_packages_is_offered_with_a_repository_and_installs_for_the_runs() {
    let dir = TestDir::new("pkgs-mcp");
    let repo = repository(dir.path(), 9);
    let repo_url = format!("file://{}", repo.display());
    let mut child = Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("mcp")
        .arg("--data-dir")
        .arg(dir.path().join("data"))
        .args([
            "--package-repo",
            &repo_url,
            "--package-allow",
            "rvbase,rvuses",
        ])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("rvisor mcp starts");
    let mut stdin = child.stdin.take().unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let mut req = |id: u64, method: &str, params: serde_json::Value| {
        mcp_request(&mut stdin, &mut stdout, id, method, params)
    };
    req(
        1,
        "initialize",
        serde_json::json!({"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "t", "version": "1"}}),
    );
    let list = req(2, "tools/list", serde_json::json!({}));
    let tools: Vec<&str> = list["result"]["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert!(tools.contains(&"install_r_packages"), "{tools:?}");
    let call = |req: &mut dyn FnMut(u64, &str, serde_json::Value) -> serde_json::Value,
                id: u64,
                tool: &str,
                args: serde_json::Value| {
        let r = req(
            id,
            "tools/call",
            serde_json::json!({"name": tool, "arguments": args}),
        );
        let text = r["result"]["content"][0]["text"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        (r["result"]["isError"].as_bool().unwrap_or(false), text)
    };
    let (err, text) = call(
        &mut req,
        3,
        "install_r_packages",
        serde_json::json!({"packages": ["rvuses"]}),
    );
    assert!(
        !err && text.contains("\"rvuses\"") && text.contains("\"rvbase\""),
        "{text}"
    );
    let (err, text) = call(
        &mut req,
        4,
        "run_r_script",
        serde_json::json!({"script": "library(rvuses); cat(uses_hello())"}),
    );
    assert!(
        !err && text.contains("rvuses and hello from rvbase"),
        "{text}"
    );
    // The allow-list refuses the rest, by its rule.
    let (err, text) = call(
        &mut req,
        5,
        "install_r_packages",
        serde_json::json!({"packages": ["rvcode"]}),
    );
    assert!(err && text.contains("rule 'allow'"), "{text}");
    let (_, text) = call(&mut req, 6, "list_r_packages", serde_json::json!({}));
    let v: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    assert_eq!(v["tenant_packages"].as_array().unwrap().len(), 2, "{v}");
    drop(stdin);
    let _ = child.wait();
}

#[test]
fn a_library_installed_on_one_node_is_used_on_another_without_building() {
    use rvisor_ffi_tests::cluster::{call, post_json, Node, NodeOptions, Store};
    let dir = TestDir::new("pkgs-nodes");
    let repo = repository(dir.path(), 9);
    let repo_url = format!("file://{}", repo.display());
    let store = dir.path().join("store");
    std::fs::create_dir_all(&store).unwrap();
    let (pa, pb) = (
        dir.path().join("packages-a").display().to_string(),
        dir.path().join("packages-b").display().to_string(),
    );
    let node = |id: &str, pkgs: &str| {
        let extra = ["--package-repo", repo_url.as_str(), "--package-dir", pkgs];
        Node::start(
            id,
            &NodeOptions {
                store: Store::Dir(&store),
                extra: &extra,
                ..NodeOptions::default()
            },
        )
    };
    let a = node("n1", &pa);
    let got = post_json(
        &a.url("/v1/packages/install"),
        "",
        serde_json::json!({"packages": ["rvuses"]}),
    );
    assert_eq!(got.status, 200, "{:?}", got.body);
    // The repository goes away: node b can only have the builds from
    // the shared store.
    std::fs::remove_dir_all(&repo).unwrap();
    let b = node("n2", &pb);
    let r = post_json(
        &b.url("/v1/run"),
        "",
        serde_json::json!({"script": "library(rvuses); cat(uses_hello())"}),
    );
    assert_eq!(
        r.body["console"], "rvuses and hello from rvbase",
        "{:?}",
        r.body
    );
    let p = call("GET", &b.url("/v1/packages"), "", None);
    let on_b: Vec<(&str, bool)> = p.body["tenant_packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["name"].as_str().unwrap(), i["cached"].as_bool().unwrap()))
        .collect();
    assert_eq!(on_b, [("rvbase", true), ("rvuses", true)], "{:?}", p.body);
    assert!(
        Path::new(&pb).join("cache").is_dir(),
        "node b keeps the builds in its cache"
    );
}

#[test]
fn the_cli_installs_into_a_local_library_that_rvisor_run_takes() {
    let dir = TestDir::new("pkgs-cli");
    let repo = repository(dir.path(), 9);
    let repo_url = format!("file://{}", repo.display());
    let bin = rvisor_ffi_tests::rvisor_bin();
    let pkgs = dir.path().join("pkgs");
    let out = Command::new(&bin)
        .args([
            "packages",
            "install",
            "rvuses",
            "--json",
            "--package-repo",
            &repo_url,
        ])
        .arg("--package-dir")
        .arg(&pkgs)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(v["installed"].as_array().unwrap().len(), 2, "{v}");
    let lib = v["library"].as_str().unwrap().to_string();
    let script = dir.path().join("use.R");
    std::fs::write(&script, "library(rvuses); cat(uses_hello())\n").unwrap();
    let out = Command::new(&bin)
        .args(["run", "--library-after", &lib])
        .arg(&script)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "rvuses and hello from rvbase"
    );
    // A refusal is a clear error and a failing exit.
    let out = Command::new(&bin)
        .args([
            "packages",
            "install",
            "nosuchpkg",
            "--package-repo",
            &repo_url,
        ])
        .arg("--package-dir")
        .arg(&pkgs)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not in any allowed repository"), "{err}");
    // `rvisor packages --json` still lists R's own.
    let out = Command::new(&bin)
        .args(["packages", "--json"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stdout).contains("\"stats\""));
}
