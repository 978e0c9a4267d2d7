//! A session's files end to end against real R (docs/files.md): uploaded
//! files R reads, files R writes downloaded byte-identical, the refused
//! names and kinds, the quotas, files surviving hibernation and a
//! restart, another tenant's session answering like an unknown one;
//! confined (as root) and unconfined.

use rvisor::file_rules::FileLimits;
use rvisor::{Confinement, Outcome, PoolConfig, Session, Supervisor, SupervisorConfig};
use rvisor_server::http::ServeConfig;
use serde_json::{json, Value};
use std::collections::HashMap;
use std::io::Read;
use std::time::Duration;

const TOK_A: &str = "alice-token-0123456789abcdef";
const TOK_B: &str = "bob-token-0123456789abcdefgh";

fn sup(confined: bool) -> Supervisor {
    let mut cfg = SupervisorConfig {
        pool: PoolConfig {
            zygote: true,
            spares: 0,
            preload: Some(Vec::new()),
            ..Default::default()
        },
        ..SupervisorConfig::default()
    };
    if !confined {
        cfg.confinement = Confinement::unconfined();
    }
    Supervisor::new(cfg).expect("the supervisor starts")
}

/// The real router on 127.0.0.1:0, with tokens for alice and bob.
struct Server {
    base: String,
    sup: Supervisor,
    rt: Option<tokio::runtime::Runtime>,
    _dir: rvisor_ffi_tests::TestDir,
}

impl Server {
    fn start(confined: bool, files: FileLimits) -> Self {
        Self::start_with(confined, files, None)
    }

    /// A node whose tables and artifacts are in `store` (shared with
    /// other nodes) rather than its own directory.
    fn start_with(confined: bool, files: FileLimits, store: Option<&std::path::Path>) -> Self {
        Self::start_ttl(confined, files, store, None)
    }

    /// As `start_with`, with the tables' and artifacts' TTL `ttl`.
    fn start_ttl(
        confined: bool,
        files: FileLimits,
        store: Option<&std::path::Path>,
        ttl: Option<Duration>,
    ) -> Self {
        let defaults = rvisor_server::tables::TableConfig::default();
        let dir = rvisor_ffi_tests::TestDir::new("files-http");
        let sup = sup(confined);
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let listener = rt
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .expect("bind");
        let addr = listener.local_addr().expect("address");
        let cfg = ServeConfig {
            tokens: Some(HashMap::from([
                (TOK_A.to_string(), "alice".to_string()),
                (TOK_B.to_string(), "bob".to_string()),
            ])),
            tables: rvisor_server::tables::TableConfig {
                dir: dir.path().join("tables"),
                store: store.map(|p| rvisor_server::blob::StoreUrl::Local(p.to_path_buf())),
                ttl: ttl.unwrap_or(defaults.ttl),
                ..defaults
            },
            files,
            ..ServeConfig::default()
        };
        let app = rvisor_server::http::router(sup.clone(), cfg).expect("the router");
        rt.spawn(async move { axum::serve(listener, app).await });
        Self {
            base: format!("http://{addr}"),
            sup,
            rt: Some(rt),
            _dir: dir,
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
        self.sup.shutdown();
    }
}

struct Answer {
    status: u16,
    content_type: String,
    bytes: Vec<u8>,
}

impl Answer {
    fn json(&self) -> Value {
        serde_json::from_slice(&self.bytes).unwrap_or_else(|e| {
            panic!(
                "not JSON ({e}): {} {}",
                self.status,
                String::from_utf8_lossy(&self.bytes)
            )
        })
    }

    /// Asserts an error of `status` and `code`; returns its message.
    fn error(&self, status: u16, code: &str) -> String {
        assert_eq!(
            self.status,
            status,
            "{}",
            String::from_utf8_lossy(&self.bytes)
        );
        let v = self.json();
        assert_eq!(v["error"]["code"], code, "{v}");
        v["error"]["message"].as_str().unwrap_or("").to_string()
    }
}

fn call(
    base: &str,
    token: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    chunked: bool,
) -> Answer {
    let agent = ureq::AgentBuilder::new()
        .max_idle_connections(0)
        .timeout(Duration::from_secs(180))
        .build();
    let req = agent
        .request(method, &format!("{base}{path}"))
        .set("Authorization", &format!("Bearer {token}"));
    let r = match body {
        Some(b) if chunked => req.send(b),
        Some(b) => req.send_bytes(b),
        None => req.call(),
    };
    let res = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {path}: {e}"),
    };
    let status = res.status();
    let content_type = res.header("content-type").unwrap_or("").to_string();
    let mut bytes = Vec::new();
    res.into_reader()
        .read_to_end(&mut bytes)
        .expect("the body reads");
    Answer {
        status,
        content_type,
        bytes,
    }
}

struct Client<'a> {
    base: &'a str,
    token: &'a str,
}

impl Client<'_> {
    fn get(&self, path: &str) -> Answer {
        call(self.base, self.token, "GET", path, None, false)
    }
    fn put(&self, path: &str, body: &[u8]) -> Answer {
        call(self.base, self.token, "PUT", path, Some(body), false)
    }
    fn put_chunked(&self, path: &str, body: &[u8]) -> Answer {
        call(self.base, self.token, "PUT", path, Some(body), true)
    }
    fn delete(&self, path: &str) -> Answer {
        call(self.base, self.token, "DELETE", path, None, false)
    }
    fn post(&self, path: &str, v: Value) -> Answer {
        let agent = ureq::AgentBuilder::new()
            .max_idle_connections(0)
            .timeout(Duration::from_secs(180))
            .build();
        let r = agent
            .post(&format!("{}{path}", self.base))
            .set("Authorization", &format!("Bearer {}", self.token))
            .send_json(v);
        let res = match r {
            Ok(r) | Err(ureq::Error::Status(_, r)) => r,
            Err(e) => panic!("POST {path}: {e}"),
        };
        let status = res.status();
        let mut bytes = Vec::new();
        res.into_reader().read_to_end(&mut bytes).unwrap();
        Answer {
            status,
            content_type: String::new(),
            bytes,
        }
    }

    fn session(&self) -> String {
        let a = self.post("/v1/sessions", json!({}));
        assert_eq!(a.status, 201, "{}", String::from_utf8_lossy(&a.bytes));
        a.json()["id"].as_str().unwrap().to_string()
    }

    /// Runs `code` in session `id`; asserts it completed; its console.
    fn run(&self, id: &str, code: &str) -> String {
        let a = self.post(&format!("/v1/sessions/{id}/run"), json!({ "code": code }));
        let v = a.json();
        assert_eq!(v["outcome"], "complete", "{code}: {v}");
        v["console"].as_str().unwrap().to_string()
    }
}

/// An `.rds` made by R on the host (Rscript), as a client would have it.
fn host_rds() -> Vec<u8> {
    let dir = rvisor_ffi_tests::TestDir::new("files-rds");
    let f = dir.path().join("fit.rds");
    let out = std::process::Command::new("Rscript")
        .arg("-e")
        .arg(format!(
            "saveRDS(list(a = 1:3, b = 'caf\\u00e9'), {:?})",
            f.display().to_string()
        ))
        .output()
        .expect("Rscript runs");
    assert!(out.status.success(), "{out:?}");
    std::fs::read(f).expect("the rds")
}

/// Hex of bytes (R's `paste(readBin(...), collapse = "")`).
fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn upload_read_write_download(confined: bool) {
    let srv = Server::start(confined, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    // In: an .rds R reads back.
    let rds = host_rds();
    let put = c.put(&format!("/v1/sessions/{id}/files/in/fit.rds"), &rds);
    assert_eq!(put.status, 201, "{}", String::from_utf8_lossy(&put.bytes));
    let info = put.json();
    assert_eq!(info["name"], "in/fit.rds");
    assert_eq!(info["size"], rds.len());
    assert_eq!(info["media_type"], "application/x-r-data");
    let out = c.run(&id, "x <- readRDS('in/fit.rds'); cat(sum(x$a), x$b, '\\n')");
    assert_eq!(out, "6 café \n");
    // Out: CSV, PDF and RDS written by R, downloaded byte-identical to
    // what R reads of them.
    c.run(
        &id,
        "write.csv(data.frame(x = 1:5, y = letters[1:5]), 'clean.csv', row.names = FALSE); \
         pdf('fig.pdf'); plot(1:10); invisible(dev.off()); \
         dir.create('out'); saveRDS(lm(dist ~ speed, cars), 'out/fit.rds')",
    );
    let listed = c.get(&format!("/v1/sessions/{id}/files"));
    assert_eq!(listed.status, 200);
    let names: Vec<String> = listed.json()["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_string())
        .collect();
    assert!(names.contains(&"clean.csv".to_string()), "{names:?}");
    assert!(names.contains(&"fig.pdf".to_string()), "{names:?}");
    for (name, ct) in [
        ("clean.csv", "text/csv"),
        ("fig.pdf", "application/pdf"),
        ("out/fit.rds", "application/x-r-data"),
    ] {
        let got = c.get(&format!("/v1/sessions/{id}/files/{name}"));
        assert_eq!(
            got.status,
            200,
            "{name}: {}",
            String::from_utf8_lossy(&got.bytes)
        );
        assert_eq!(got.content_type, ct, "{name}");
        let r_hex = c.run(
            &id,
            &format!("cat(paste(readBin('{name}', 'raw', file.size('{name}')), collapse = ''))"),
        );
        assert_eq!(hex(&got.bytes), r_hex, "{name} differs from what R wrote");
        assert!(!got.bytes.is_empty());
    }
    // An .xlsx (readxl's own example, as a client would send it) read by
    // readxl in the session.
    let xlsx = std::fs::read("/usr/lib/R/site-library/readxl/extdata/datasets.xlsx")
        .expect("readxl is installed (scripts/setup.sh)");
    let put = c.put(&format!("/v1/sessions/{id}/files/sales.xlsx"), &xlsx);
    assert_eq!(put.status, 201);
    assert_eq!(
        put.json()["media_type"],
        "application/vnd.openxmlformats-officedocument.spreadsheetml.sheet"
    );
    let out = c.run(
        &id,
        "x <- readxl::read_excel('sales.xlsx', sheet = 'mtcars'); cat(nrow(x), ncol(x))",
    );
    assert_eq!(out, "32 11");
    // Delete, then it is gone for R too.
    assert_eq!(
        c.delete(&format!("/v1/sessions/{id}/files/clean.csv"))
            .status,
        204
    );
    assert_eq!(c.run(&id, "cat(file.exists('clean.csv'))"), "FALSE");
    c.get(&format!("/v1/sessions/{id}/files/clean.csv"))
        .error(404, "not_found");
}

/// Each session call reports the files it changed, compared with a listing
/// before it. A listing taken while the session is idle is kept and is the
/// next call's "before" (no second walk of the worker's directory) only
/// while nothing can have changed the files: so a file put or deleted
/// through the API between calls is not reported as the next call's, and a
/// file the call recreates or appends to is.
fn calls_report_what_they_changed(confined: bool) {
    let srv = Server::start(confined, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    let changed = |code: &str| -> Vec<String> {
        let a = c.post(&format!("/v1/sessions/{id}/run"), json!({ "code": code }));
        let v = a.json();
        assert_eq!(v["outcome"], "complete", "{code}: {v}");
        let mut names: Vec<String> = v["artifacts"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|f| f["name"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    assert_eq!(changed("writeLines('a', 'a.txt')"), ["a.txt"]);
    assert!(changed("x <- 1").is_empty());
    assert!(changed("x <- 2").is_empty());
    // Put between calls: the API's change, not the call's.
    assert_eq!(
        c.put(&format!("/v1/sessions/{id}/files/b.txt"), b"b")
            .status,
        201
    );
    assert!(changed("x <- 3").is_empty());
    assert_eq!(changed("writeLines('b2', 'b.txt')"), ["b.txt"]);
    // Deleted through the API, then made again by a call: the call's.
    assert_eq!(
        c.delete(&format!("/v1/sessions/{id}/files/a.txt")).status,
        204
    );
    assert_eq!(changed("writeLines('a', 'a.txt')"), ["a.txt"]);
    // The same name, more bytes.
    assert_eq!(
        changed("cat('more', file = 'a.txt', append = TRUE)"),
        ["a.txt"]
    );
    assert!(changed("x <- 4").is_empty());
}

#[test]
fn confined_calls_report_what_they_changed() {
    calls_report_what_they_changed(true);
}

#[test]
fn unconfined_calls_report_what_they_changed() {
    calls_report_what_they_changed(false);
}

#[test]
fn confined_files_go_in_and_out_byte_identical() {
    upload_read_write_download(true);
}

#[test]
fn unconfined_files_go_in_and_out_byte_identical() {
    upload_read_write_download(false);
}

fn refusals(confined: bool) {
    let srv = Server::start(confined, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    // Names.
    let long = "x".repeat(300);
    // (`a/../b` and `./a` are resolved by HTTP clients before they are
    // sent; the library's refusal of them is tested in durable_files.)
    for bad in [
        "..%2Fescape",
        "a%2F..%2F..%2Fb",
        "a%00b",
        ".%2Fa",
        "a//b",
        long.as_str(),
        "caf%5Cb",
    ] {
        let a = c.put(&format!("/v1/sessions/{id}/files/{bad}"), b"no");
        let m = a.error(409, "file_refused");
        assert!(m.contains("relative path"), "{bad}: {m}");
    }
    // An absolute path (a leading slash after `files/`).
    let a = c.put(&format!("/v1/sessions/{id}/files//etc/x"), b"no");
    a.error(409, "file_refused");
    // Kinds R makes: a symlink out of the directory, a symlinked
    // directory, a FIFO. None is listed, read, written or deleted.
    c.run(
        &id,
        "invisible(file.symlink('/etc/passwd', 'link')); invisible(file.symlink('/etc', 'etcdir')); \
         f <- fifo('pipe', 'w+'); close(f); writeLines('ok', 'real.txt')",
    );
    let listed = c.get(&format!("/v1/sessions/{id}/files")).json();
    let names: Vec<&str> = listed["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["real.txt"], "{listed}");
    for (name, kind) in [
        ("link", "symlink"),
        ("pipe", "FIFO"),
        ("etcdir/passwd", "symlink"),
    ] {
        let m = c
            .get(&format!("/v1/sessions/{id}/files/{name}"))
            .error(409, "file_refused");
        assert!(m.contains(kind), "{name}: {m}");
        c.put(&format!("/v1/sessions/{id}/files/{name}"), b"x")
            .error(409, "file_refused");
    }
    c.delete(&format!("/v1/sessions/{id}/files/link"))
        .error(409, "file_refused");
    // The symlink still points where it did, /etc/passwd untouched.
    assert_eq!(c.run(&id, "cat(Sys.readlink('link'))"), "/etc/passwd");
}

#[test]
fn confined_refused_names_and_kinds() {
    refusals(true);
}

#[test]
fn unconfined_refused_names_and_kinds() {
    refusals(false);
}

#[test]
fn quotas_refuse_and_a_failed_upload_keeps_the_old_file() {
    let srv = Server::start(
        true,
        FileLimits {
            max_file_bytes: 1000,
            max_session_bytes: 1500,
            max_tenant_bytes: 1800,
            max_files: 3,
            ..FileLimits::default()
        },
    );
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    let p = |n: &str| format!("/v1/sessions/{id}/files/{n}");
    assert_eq!(c.put(&p("a.txt"), b"old").status, 201);
    // Announced over max_file_bytes: refused before the body is read.
    let m = c.put(&p("a.txt"), &[b'x'; 1001]).error(413, "too_large");
    assert!(m.contains("max_file_bytes"), "{m}");
    // Chunked (no length): refused as it passes the limit.
    let m = c
        .put_chunked(&p("a.txt"), &[b'y'; 5000])
        .error(413, "too_large");
    assert!(m.contains("max_file_bytes"), "{m}");
    // The old file is intact, and no temporary file is left or listed.
    assert_eq!(c.get(&p("a.txt")).bytes, b"old");
    let listed = c.get(&format!("/v1/sessions/{id}/files")).json();
    assert_eq!(
        listed["files"].as_array().map(Vec::len),
        Some(1),
        "{listed}"
    );
    assert_eq!(
        c.run(
            &id,
            "cat(length(list.files(all.files = TRUE, pattern = '^[.]rvisor')))"
        ),
        "0"
    );
    // The session's bytes.
    assert_eq!(c.put(&p("b.bin"), &[1u8; 900]).status, 201);
    let m = c.put(&p("c.bin"), &[2u8; 900]).error(429, "quota");
    assert!(m.contains("max_session_bytes"), "{m}");
    // The count of files.
    assert_eq!(c.put(&p("c.bin"), b"c").status, 201);
    let m = c.put(&p("d.bin"), b"d").error(429, "quota");
    assert!(m.contains("max_files"), "{m}");
    // The tenant's bytes, over two sessions.
    let id2 = c.session();
    let m = c
        .put(&format!("/v1/sessions/{id2}/files/e.bin"), &[3u8; 1000])
        .error(429, "quota");
    assert!(m.contains("max_tenant_bytes"), "{m}");
    // /v1/usage shows them.
    let u = c.get("/v1/usage").json();
    assert_eq!(u["file_bytes"], 3 + 900 + 1, "{u}");
    assert_eq!(u["file_quota_bytes"], 1800, "{u}");
    // Closing the session forgets its bytes.
    assert_eq!(c.delete(&format!("/v1/sessions/{id}")).status, 204);
    assert_eq!(c.get("/v1/usage").json()["file_bytes"], 0);
}

#[test]
fn another_tenants_files_answer_like_an_unknown_session() {
    let srv = Server::start(true, FileLimits::default());
    let alice = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let bob = Client {
        base: &srv.base,
        token: TOK_B,
    };
    let id = alice.session();
    assert_eq!(
        alice
            .put(&format!("/v1/sessions/{id}/files/secret.txt"), b"alice's")
            .status,
        201
    );
    let unknown = "0123456789abcdef0123456789abcdef";
    let answers = |who: &Client, sid: &str| -> Vec<(u16, Value)> {
        let p = format!("/v1/sessions/{sid}/files");
        [
            who.get(&p),
            who.get(&format!("{p}/secret.txt")),
            who.put(&format!("{p}/secret.txt"), b"bob's"),
            who.delete(&format!("{p}/secret.txt")),
        ]
        .into_iter()
        .map(|a| {
            let v = a.json();
            let m = v["error"]["message"]
                .as_str()
                .unwrap_or("")
                .replace(sid, "ID");
            (a.status, json!({"code": v["error"]["code"], "message": m}))
        })
        .collect()
    };
    let theirs = answers(&bob, &id);
    let none = answers(&bob, unknown);
    assert_eq!(theirs, none);
    assert!(theirs.iter().all(|(s, _)| *s == 404), "{theirs:?}");
    // Alice's file is untouched.
    assert_eq!(
        alice
            .get(&format!("/v1/sessions/{id}/files/secret.txt"))
            .bytes,
        b"alice's"
    );
}

fn durable_files(confined: bool) {
    use rvisor::checkpoint::DirStore;
    use std::sync::Arc;
    let dir = rvisor_ffi_tests::TestDir::new("files-durable");
    let make = || {
        let mut cfg = SupervisorConfig {
            checkpoints: Some(Arc::new(DirStore::new(dir.path()).unwrap())),
            ..SupervisorConfig::default()
        };
        if !confined {
            cfg.confinement = Confinement::unconfined();
        }
        Supervisor::new(cfg).expect("the supervisor starts")
    };
    let sup1 = make();
    let s = sup1
        .session_with(rvisor_ffi_tests::durable::manual())
        .unwrap();
    let rds = host_rds();
    for bad in ["/etc/x", "../x", "a/../../b", "./a", "a\0b", ""] {
        let e = s.put_file(bad, &mut &b"x"[..]).unwrap_err();
        assert!(
            matches!(
                e,
                rvisor::files::FileError::Refused(rvisor::file_rules::FileRefusal::Name { .. })
            ),
            "{bad:?}: {e}"
        );
    }
    s.put_file("keep/fit.rds", &mut rds.as_slice()).unwrap();
    rvisor_ffi_tests::durable::ok(&s, "writeLines('from R', 'r.txt')");
    // Hibernated: the worker is gone; the files come back with it.
    s.hibernate_and_wait(Duration::from_secs(120)).unwrap();
    assert_eq!(s.status().pid, None);
    let read = |s: &Session, name: &str| {
        let (_, mut f) = s.get_file(name).unwrap();
        let mut v = Vec::new();
        f.read_to_end(&mut v).unwrap();
        v
    };
    assert_eq!(read(&s, "keep/fit.rds"), rds);
    assert_eq!(read(&s, "r.txt"), b"from R\n");
    // A restart: released here, resumed by another supervisor.
    let id = s.id().to_string();
    s.release(Duration::from_secs(120)).unwrap();
    sup1.shutdown();
    let sup2 = make();
    let s2 = sup2
        .resume_session(&id, rvisor_ffi_tests::durable::manual(), "restart")
        .unwrap();
    assert_eq!(read(&s2, "keep/fit.rds"), rds);
    let r = rvisor_ffi_tests::durable::ok(&s2, "cat(readRDS('keep/fit.rds')$b)");
    assert_eq!(r.console, "café");
    assert_eq!(r.outcome, Outcome::Complete);
    // Closing deletes them (a new session starts empty).
    s2.close();
    let s3 = sup2.session().unwrap();
    assert!(s3.files().unwrap().is_empty());
    sup2.shutdown();
}

#[test]
fn confined_files_survive_hibernation_and_a_restart() {
    durable_files(true);
}

#[test]
fn unconfined_files_survive_hibernation_and_a_restart() {
    durable_files(false);
}

fn artifacts(confined: bool) {
    use base64::Engine as _;
    let shared = rvisor_ffi_tests::TestDir::new("files-store");
    let one = Server::start_with(confined, FileLimits::default(), Some(shared.path()));
    let two = Server::start_with(confined, FileLimits::default(), Some(shared.path()));
    let c1 = Client {
        base: &one.base,
        token: TOK_A,
    };
    let rds = host_rds();
    let b64 = base64::engine::general_purpose::STANDARD.encode(&rds);
    let a = c1.post(
        "/v1/run",
        json!({
            "script": "x <- readRDS('in/fit.rds'); write.csv(data.frame(a = x$a), 'out.csv', row.names = FALSE); \
                       pdf('fig.pdf'); plot(x$a); invisible(dev.off()); saveRDS(x, 'again.rds'); \
                       writeLines('scratch', file.path(tempdir(), 'not-an-artifact.txt'))",
            "files": [{"name": "in/fit.rds", "content_base64": b64}]
        }),
    );
    let r = a.json();
    assert_eq!(r["outcome"], "complete", "{r}");
    let arts = r["artifacts"].as_array().expect("artifacts").clone();
    let names: Vec<&str> = arts.iter().map(|a| a["name"].as_str().unwrap()).collect();
    // The input, unchanged, is not an artifact; tempdir() is not either.
    assert_eq!(names, vec!["again.rds", "fig.pdf", "out.csv"], "{r}");
    // Fetched from the other node, byte for byte what R wrote (its sha256,
    // and the csv's text), by the reference the result gives.
    let c2 = Client {
        base: &two.base,
        token: TOK_A,
    };
    for art in &arts {
        let uri = art["uri"].as_str().unwrap();
        let got = c2.get(uri);
        assert_eq!(
            got.status,
            200,
            "{uri}: {}",
            String::from_utf8_lossy(&got.bytes)
        );
        assert_eq!(got.bytes.len() as u64, art["size"].as_u64().unwrap());
        assert_eq!(got.content_type, art["media_type"].as_str().unwrap());
        use sha2::Digest;
        let sha: String = sha2::Sha256::digest(&got.bytes)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        assert_eq!(sha, art["sha256"].as_str().unwrap(), "{uri}");
    }
    let csv = c2.get(arts[2]["uri"].as_str().unwrap());
    assert_eq!(csv.bytes, b"\"a\"\n1\n2\n3\n");
    // Another tenant's artifact answers like an unknown one.
    let bob = Client {
        base: &two.base,
        token: TOK_B,
    };
    let uri = arts[0]["uri"].as_str().unwrap();
    let theirs = bob.get(uri);
    let none = bob.get("/v1/artifacts/0123456789abcdef/again.rds");
    assert_eq!(theirs.status, 404);
    assert_eq!(theirs.json(), none.json());
    // A refused input name: nothing runs.
    let a = c1.post(
        "/v1/run",
        json!({"script": "1", "files": [{"name": "../x", "content_base64": ""}]}),
    );
    a.error(409, "file_refused");
}

/// The regular files below `dir`, recursively (none when it is missing).
fn files_below(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
            let t = e.file_type().expect("a file type");
            if t.is_dir() {
                todo.push(e.path());
            } else if t.is_file() {
                out.push(e.path());
            }
        }
    }
    out
}

/// A run's artifacts count against the tenant's quota of files until they
/// expire; a run over the quota still answers, its artifacts not kept and
/// its warnings saying which limit. Artifacts that expire unread are swept
/// from the store and stop counting: `/v1/usage` goes back down and a
/// session upload refused meanwhile (429) is accepted.
#[test]
fn expired_artifacts_unread_stop_counting_against_the_tenant() {
    let shared = rvisor_ffi_tests::TestDir::new("files-store");
    let srv = Server::start_ttl(
        true,
        FileLimits {
            max_tenant_bytes: 1800,
            ..FileLimits::default()
        },
        Some(shared.path()),
        Some(Duration::from_secs(3)),
    );
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let r = c
        .post(
            "/v1/run",
            json!({"script": "writeBin(as.raw(rep(1L, 1500)), 'big.bin')"}),
        )
        .json();
    assert_eq!(r["outcome"], "complete", "{r}");
    assert_eq!(r["artifacts"][0]["size"], 1500, "{r}");
    let stored = shared.path().join("artifacts");
    assert_eq!(files_below(&stored).len(), 2, "the object and its set");
    // Over the quota: the run's own result comes back, its artifacts not.
    let r2 = c
        .post(
            "/v1/run",
            json!({"script": "writeBin(as.raw(rep(2L, 500)), 'more.bin'); cat('ran')"}),
        )
        .json();
    assert_eq!(r2["outcome"], "complete", "{r2}");
    assert_eq!(r2["console"], "ran", "{r2}");
    assert!(r2["artifacts"].is_null(), "{r2}");
    let w = r2["warnings"].to_string();
    assert!(
        w.contains("not kept") && w.contains("max_tenant_bytes") && w.contains("expire"),
        "{w}"
    );
    assert_eq!(files_below(&stored).len(), 2, "nothing more stored");
    assert_eq!(c.get("/v1/usage").json()["file_bytes"], 1500);
    let id = c.session();
    let up = format!("/v1/sessions/{id}/files/up.bin");
    let m = c.put(&up, &[3u8; 500]).error(429, "quota");
    assert!(m.contains("max_tenant_bytes"), "{m}");
    // Nobody reads the artifact: once expired it is swept and released.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let u = c.get("/v1/usage").json();
        let left = files_below(&stored);
        if u["file_bytes"] == 0 && left.is_empty() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "not swept 30 s on: {u}, {left:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(c.put(&up, &[3u8; 500]).status, 201);
    assert_eq!(c.get("/v1/usage").json()["file_bytes"], 500);
}

/// Artifacts stored by a process gone since (a restart; a node of a shared
/// store that died) are swept from the store too once expired, by the
/// next node's listing of the store.
#[test]
fn expired_artifacts_of_a_gone_node_are_swept_from_the_store() {
    let shared = rvisor_ffi_tests::TestDir::new("files-store");
    let stored = shared.path().join("artifacts");
    let ttl = Some(Duration::from_secs(2));
    {
        let one = Server::start_ttl(false, FileLimits::default(), Some(shared.path()), ttl);
        let c = Client {
            base: &one.base,
            token: TOK_A,
        };
        let r = c
            .post("/v1/run", json!({"script": "writeLines('x', 'out.txt')"}))
            .json();
        assert_eq!(r["artifacts"][0]["name"], "out.txt", "{r}");
    }
    let sets: Vec<_> = files_below(&stored)
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "json"))
        .collect();
    assert_eq!(sets.len(), 1, "{sets:?}");
    let set: Value = serde_json::from_slice(&std::fs::read(&sets[0]).unwrap()).unwrap();
    let expires = set["expires_unix"].as_u64().expect("expires_unix");
    let now = || rvisor::clock::unix_now();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while now() <= expires {
        assert!(
            std::time::Instant::now() < deadline,
            "the clock stands still"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // A new node on the same store: nobody asks for the artifact.
    let _two = Server::start_ttl(false, FileLimits::default(), Some(shared.path()), ttl);
    while !files_below(&stored).is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "not swept: {:?}",
            files_below(&stored)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn confined_run_artifacts_are_served_by_another_node() {
    artifacts(true);
}

#[test]
fn unconfined_run_artifacts_are_served_by_another_node() {
    artifacts(false);
}

/// `session --jsonl` (the adapter, over socket pairs): small files inline
/// as base64 both ways, a large one refused naming the inline limit.
#[test]
fn jsonl_files_travel_inline_and_large_ones_are_refused_by_name() {
    use base64::Engine as _;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let sup = sup(true);
    let (mut to_server, server_in) = UnixStream::pair().unwrap();
    let (server_out, from_server) = UnixStream::pair().unwrap();
    let s2 = sup.clone();
    let t = std::thread::spawn(move || {
        rvisor_server::jsonl::serve(&s2, BufReader::new(server_in), server_out).unwrap()
    });
    let mut lines = BufReader::new(from_server).lines();
    let mut ask = |v: Value| -> Value {
        writeln!(to_server, "{v}").unwrap();
        let line = lines.next().expect("an answer").unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let rds = host_rds();
    let a = ask(json!({"id": 1, "op": "put_file", "path": "fit.rds", "content_base64": b64(&rds)}));
    assert_eq!(a["file"]["size"], rds.len(), "{a}");
    let a = ask(
        json!({"id": 2, "op": "run", "code": "x <- readRDS('fit.rds'); saveRDS(x$a * 2L, 'twice.rds'); cat(x$b)"}),
    );
    assert_eq!(a["result"]["console"], "café", "{a}");
    let a = ask(json!({"id": 3, "op": "files"}));
    let names: Vec<&str> = a["files"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, vec!["fit.rds", "twice.rds"], "{a}");
    let a = ask(json!({"id": 4, "op": "get_file", "path": "fit.rds"}));
    assert_eq!(a["file"]["content_base64"], b64(&rds), "{a}");
    // Over the inline limit: refused, naming it and the way out.
    let a = ask(
        json!({"id": 5, "op": "run", "code": "writeBin(as.raw(rep(1, 300 * 1024)), 'big.bin')"}),
    );
    assert_eq!(a["result"]["outcome"], "complete", "{a}");
    let a = ask(json!({"id": 6, "op": "get_file", "path": "big.bin"}));
    assert_eq!(a["error"]["code"], "too_large", "{a}");
    let m = a["error"]["message"].as_str().unwrap();
    assert!(m.contains("inline limit") && m.contains("HTTP"), "{m}");
    let a = ask(json!({"id": 7, "op": "get_file", "path": "../etc/passwd"}));
    assert_eq!(a["error"]["code"], "file_refused", "{a}");
    let a = ask(json!({"id": 8, "op": "delete_file", "path": "big.bin"}));
    assert_eq!(a["deleted"], "big.bin", "{a}");
    drop(to_server);
    t.join().unwrap();
    sup.shutdown();
}

/// `rvisor run --input FILE --output-dir DIR` (confined, as root runs it):
/// the input read by R, the files R wrote copied out byte for byte and
/// listed as artifacts, tempdir() and the unchanged input left out.
#[test]
fn cli_run_takes_inputs_and_saves_outputs() {
    let dir = rvisor_ffi_tests::TestDir::new("files-cli");
    let input = dir.path().join("fit.rds");
    std::fs::write(&input, host_rds()).unwrap();
    let script = dir.path().join("s.R");
    std::fs::write(
        &script,
        "x <- readRDS('fit.rds'); dir.create('out')\n\
         write.csv(data.frame(a = x$a), 'out/a.csv', row.names = FALSE)\n\
         writeLines('t', file.path(tempdir(), 'scratch.txt'))\n",
    )
    .unwrap();
    let out_dir = dir.path().join("out");
    let out = std::process::Command::new(rvisor_ffi_tests::rvisor_bin())
        .arg("run")
        .arg("--json")
        .arg("--input")
        .arg(&input)
        .arg("--output-dir")
        .arg(&out_dir)
        .arg(&script)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stderr)));
    assert_eq!(r["outcome"], "complete", "{r}");
    let arts = r["artifacts"].as_array().expect("artifacts");
    assert_eq!(arts.len(), 1, "{r}");
    assert_eq!(arts[0]["name"], "out/a.csv");
    let saved = std::fs::read(out_dir.join("out/a.csv")).unwrap();
    assert_eq!(saved, b"\"a\"\n1\n2\n3\n");
    use sha2::Digest;
    let sha: String = sha2::Sha256::digest(&saved)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(arts[0]["sha256"], sha);
}

/// MCP (the adapter, over socket pairs): `run_r_code` answers the files it
/// wrote as `resource_link`s, `resources/list` lists the session's files,
/// `resources/read` returns one (text or base64), and `run_r_script` takes
/// an input file and links its artifacts, readable the same way.
#[test]
fn mcp_files_are_resources_and_results_link_them() {
    use base64::Engine as _;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    let sup = sup(true);
    let dir = rvisor_ffi_tests::TestDir::new("files-mcp");
    let (mut to_server, server_in) = UnixStream::pair().unwrap();
    let (server_out, from_server) = UnixStream::pair().unwrap();
    let s2 = sup.clone();
    let tables = rvisor_server::tables::TableConfig {
        dir: dir.path().join("tables"),
        ..Default::default()
    };
    let t = std::thread::spawn(move || {
        rvisor_server::mcp::serve(&s2, tables, BufReader::new(server_in), server_out).unwrap()
    });
    let mut lines = BufReader::new(from_server).lines();
    let mut n = 0;
    let mut ask = |method: &str, params: Value| -> Value {
        n += 1;
        let msg = json!({"jsonrpc": "2.0", "id": n, "method": method, "params": params});
        writeln!(to_server, "{msg}").unwrap();
        loop {
            let line = lines.next().expect("an answer").unwrap();
            let v: Value = serde_json::from_str(&line).unwrap();
            if v["id"] == n {
                return v;
            }
        }
    };
    let init = ask("initialize", json!({"protocolVersion": "2025-06-18"}));
    assert!(
        init["result"]["capabilities"]["resources"].is_object(),
        "{init}"
    );
    let r = ask(
        "tools/call",
        json!({"name": "run_r_code", "arguments": {"code": "write.csv(head(cars, 2), 'cars.csv', row.names = FALSE)"}}),
    );
    let links: Vec<&Value> = r["result"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|c| c["type"] == "resource_link")
        .collect();
    assert_eq!(links.len(), 1, "{r}");
    assert_eq!(links[0]["uri"], "rvisor://session/main/files/cars.csv");
    let want = "\"speed\",\"dist\"\n4,2\n4,10\n";
    use sha2::Digest;
    let sha: String = sha2::Sha256::digest(want.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        r["result"]["structuredContent"]["artifacts"][0]["sha256"], sha,
        "{r}"
    );
    // A call that changes nothing links nothing.
    let r = ask(
        "tools/call",
        json!({"name": "run_r_code", "arguments": {"code": "1"}}),
    );
    assert!(
        !r["result"]["content"]
            .as_array()
            .unwrap()
            .iter()
            .any(|c| c["type"] == "resource_link"),
        "{r}"
    );
    let l = ask("resources/list", json!({}));
    assert_eq!(
        l["result"]["resources"][0]["uri"], "rvisor://session/main/files/cars.csv",
        "{l}"
    );
    let read = ask(
        "resources/read",
        json!({"uri": "rvisor://session/main/files/cars.csv"}),
    );
    assert_eq!(read["result"]["contents"][0]["text"], want, "{read}");
    // A one-shot run: an input in, an artifact linked and readable.
    let rds = host_rds();
    let r = ask(
        "tools/call",
        json!({"name": "run_r_script", "arguments": {
            "script": "x <- readRDS('fit.rds'); saveRDS(rev(x$a), 'rev.rds')",
            "files": [{"name": "fit.rds", "content_base64": base64::engine::general_purpose::STANDARD.encode(&rds)}]
        }}),
    );
    let link = r["result"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["type"] == "resource_link")
        .unwrap_or_else(|| panic!("no link: {r}"))
        .clone();
    assert_eq!(link["name"], "rev.rds");
    let read = ask("resources/read", json!({"uri": link["uri"]}));
    let blob = base64::engine::general_purpose::STANDARD
        .decode(read["result"]["contents"][0]["blob"].as_str().unwrap())
        .unwrap();
    assert_eq!(blob.len() as u64, link["size"].as_u64().unwrap(), "{read}");
    let bad = ask(
        "resources/read",
        json!({"uri": "rvisor://session/main/files/../x"}),
    );
    assert!(bad["error"].is_object(), "{bad}");
    drop(to_server);
    t.join().unwrap();
    sup.shutdown();
}

/// The tenant's quota of files counts what the store holds, not what one
/// process saw: a run's artifacts and a session's file, stored by a node
/// that is then restarted, count on the same node started again over the
/// store and on a second node of it (`/v1/usage` shows the same bytes on
/// both), and an upload that would pass the quota is refused (429
/// `quota`) on either.
#[test]
fn a_tenants_file_bytes_survive_a_restart_and_count_on_every_node() {
    use rvisor_ffi_tests::cluster::{call, post_json, Node};
    let store = rvisor_ffi_tests::TestDir::new("files-quota-store");
    let opts = quota_nodes(store.path());
    let (usage, new_session, upload) = (node_file_bytes, node_session, node_upload);
    let one = Node::start("n1", &opts);
    let r = post_json(
        &one.url("/v1/run"),
        "t",
        json!({"script": "writeBin(as.raw(rep(1:255, length.out = 400000)), 'a.bin')"}),
    );
    assert_eq!(r.status, 200, "{r:?}");
    assert_eq!(r.body["artifacts"][0]["size"], 400000, "{r:?}");
    let id = new_session(&one);
    let r = post_json(
        &one.url(&format!("/v1/sessions/{id}/run")),
        "t",
        json!({"code": "x <- 1"}),
    );
    assert_eq!(r.body["outcome"], "complete", "{r:?}");
    // Checkpointed before the upload: the upload makes the checkpoint
    // behind, so the release writes a new one with the file.
    let ck = post_json(
        &one.url(&format!("/v1/sessions/{id}/checkpoint")),
        "t",
        json!({}),
    );
    assert_eq!(ck.body["written"], true, "{ck:?}");
    let up = upload(&one, &id, "up.bin", 300000);
    assert_eq!(up.status, 201, "{up:?}");
    assert_eq!(usage(&one), 700000);
    // Restarted (SIGTERM: its sessions are checkpointed and released, so
    // the session's file is still there after it).
    let (port, mut one) = (one.port, one);
    one.signal(libc::SIGTERM);
    rvisor_ffi_tests::wait_for("node n1 to exit", Duration::from_secs(60), || {
        one.serve.child.try_wait().ok().flatten()
    });
    drop(one);
    let one = Node::start_on("n1", port, &opts);
    assert_eq!(usage(&one), 700000, "after the restart");
    let two = Node::start("n2", &opts);
    assert_eq!(usage(&two), 700000, "on another node of the store");
    // 1 MiB is 1,048,576 bytes: 400,000 more would pass it, on either node.
    let other = new_session(&two);
    let m = upload(&two, &other, "more.bin", 400000);
    assert_eq!(m.status, 429, "{m:?}");
    assert_eq!(m.body["error"]["code"], "quota", "{m:?}");
    let msg = m.body["error"]["message"].as_str().unwrap_or("");
    assert!(msg.contains("max_tenant_bytes"), "{msg}");
    // The session's file is there (it was uploaded after the session's
    // last call: the release checkpointed it).
    let l = call(
        "GET",
        &one.url(&format!("/v1/sessions/{id}/files")),
        "t",
        None,
    );
    assert_eq!(l.body["files"][0]["size"], 300000, "{l:?}");
    let m = upload(&one, &id, "more.bin", 400000);
    assert_eq!(m.status, 429, "{m:?}");
    // What fits is taken, and counts on the other node once its count of
    // the store is read again (within STORED_FILE_BYTES_TTL).
    let ok = upload(&two, &other, "fits.bin", 300000);
    assert_eq!(ok.status, 201, "{ok:?}");
    assert_eq!(usage(&two), 1000000);
    rvisor_ffi_tests::wait_for(
        "node n1 to count n2's upload",
        Duration::from_secs(30),
        || (usage(&one) == 1000000).then_some(()),
    );
    // Closing a session releases its bytes on every node.
    let c = call(
        "DELETE",
        &two.url(&format!("/v1/sessions/{other}")),
        "t",
        None,
    );
    assert_eq!(c.status, 204, "{c:?}");
    assert_eq!(usage(&two), 700000);
    rvisor_ffi_tests::wait_for("node n1 to see the close", Duration::from_secs(30), || {
        (usage(&one) == 700000).then_some(())
    });
}

/// An upload to a session this node has not counted yet, on a node whose
/// count of the store is stale (here: not read yet) while the store holds
/// another node's session's files, reads the store's count and is
/// answered, and the tenant's usage then counts both. (The upload once
/// held the lock that reading the count takes: it hung, and with it every
/// later count of the node; the OpenAPI fuzzing found it.)
#[test]
fn an_upload_to_an_uncounted_session_reads_the_stores_count() {
    use rvisor_ffi_tests::cluster::Node;
    let store = rvisor_ffi_tests::TestDir::new("files-count-store");
    let opts = quota_nodes(store.path());
    let (new_session, upload) = (node_session, node_upload);
    let one = Node::start("n1", &opts);
    let id = new_session(&one);
    let up = upload(&one, &id, "a.bin", 1000);
    assert_eq!(up.status, 201, "{up:?}");
    // A second node: its first upload, before anything else counted the
    // tenant's files there (the client gives up after 120 s: a hang fails).
    let two = Node::start("n2", &opts);
    let other = new_session(&two);
    let up = upload(&two, &other, "b.bin", 2000);
    assert_eq!(up.status, 201, "{up:?}");
    assert_eq!(node_file_bytes(&two), 3000);
}

/// Nodes over the store directory `store` with a 1 MiB quota of files
/// per tenant.
fn quota_nodes(store: &std::path::Path) -> rvisor_ffi_tests::cluster::NodeOptions<'_> {
    rvisor_ffi_tests::cluster::NodeOptions {
        store: rvisor_ffi_tests::cluster::Store::Dir(store),
        extra: &["--file-quota-mb", "1"],
        ..Default::default()
    }
}

/// The bytes of tenant `t`'s files as node `n`'s `/v1/usage` counts them.
fn node_file_bytes(n: &rvisor_ffi_tests::cluster::Node) -> serde_json::Value {
    let u = rvisor_ffi_tests::cluster::call("GET", &n.url("/v1/usage"), "t", None);
    assert_eq!(u.status, 200, "{u:?}");
    u.body["file_bytes"].clone()
}

/// A new session of tenant `t` on node `n`.
fn node_session(n: &rvisor_ffi_tests::cluster::Node) -> String {
    let a = rvisor_ffi_tests::cluster::post_json(&n.url("/v1/sessions"), "t", json!({}));
    assert_eq!(a.status, 201, "{a:?}");
    a.body["id"].as_str().unwrap().to_string()
}

/// `len` bytes uploaded as file `name` of session `id` on node `n`.
fn node_upload(
    n: &rvisor_ffi_tests::cluster::Node,
    id: &str,
    name: &str,
    len: usize,
) -> rvisor_ffi_tests::cluster::Answer {
    rvisor_ffi_tests::cluster::call(
        "PUT",
        &n.url(&format!("/v1/sessions/{id}/files/{name}")),
        "t",
        Some(("application/octet-stream", vec![7u8; len])),
    )
}

/// The `.objects` folders of a directory store: the files kept beside
/// checkpoints, by sha256, and their lists.
fn objects_in(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        if e.file_name().to_string_lossy().ends_with(".objects") {
            for o in std::fs::read_dir(e.path()).unwrap().flatten() {
                out.push(o.path());
            }
        }
    }
    out.sort();
    out
}

/// A file past the checkpoint's cap on files (64 MiB) is stored beside
/// the checkpoint and restored with it: R writes 70 MB, and after a
/// hibernation and after a restart its size and md5 are the same. An
/// object missing from the store gives a session restored without that
/// file and a warning naming it; closing the session deletes the objects.
fn big_files_beside_the_checkpoint(confined: bool) {
    use rvisor::checkpoint::DirStore;
    use rvisor_ffi_tests::durable::{manual, ok};
    use std::sync::Arc;
    let dir = rvisor_ffi_tests::TestDir::new("files-beside");
    let make = || {
        let mut cfg = SupervisorConfig {
            checkpoints: Some(Arc::new(DirStore::new(dir.path()).unwrap())),
            ..SupervisorConfig::default()
        };
        if !confined {
            cfg.confinement = Confinement::unconfined();
        }
        Supervisor::new(cfg).expect("the supervisor starts")
    };
    let check = "cat(format(file.size('big.bin'), scientific = FALSE), tools::md5sum('big.bin'))";
    let sup1 = make();
    let s = sup1.session_with(manual()).unwrap();
    ok(
        &s,
        "writeBin(as.raw(rep(1:255, length.out = 70e6)), 'big.bin'); writeLines('small', 'small.txt')",
    );
    let want = ok(&s, check).console;
    assert!(want.starts_with("70000000 "), "{want}");
    let info = s.checkpoint().unwrap();
    assert_eq!(info.manifest.files_beside, vec!["big.bin".to_string()]);
    assert!(
        info.manifest.files_skipped.is_empty(),
        "{:?}",
        info.manifest
    );
    assert_eq!(info.manifest.files, vec!["small.txt".to_string()]);
    // The file's object and the list of them.
    let objects = objects_in(dir.path());
    assert_eq!(objects.len(), 2, "{objects:?}");
    // Hibernated: the worker (and, confined, its tmpfs) is gone.
    s.hibernate_and_wait(Duration::from_secs(120)).unwrap();
    assert_eq!(s.status().pid, None);
    let r = ok(&s, check);
    assert!(r.console.ends_with(&format!("\n{want}")), "{}", r.console);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    // A restart: released here, resumed by another supervisor; a second
    // checkpoint of the same file shares its object.
    let id = s.id().to_string();
    ok(&s, "y <- 2");
    s.release(Duration::from_secs(120)).unwrap();
    sup1.shutdown();
    assert_eq!(objects_in(dir.path()), objects);
    let sup2 = make();
    let s2 = sup2.resume_session(&id, manual(), "restart").unwrap();
    let r = ok(&s2, check);
    assert!(r.console.ends_with(&format!("\n{want}")), "{}", r.console);
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(ok(&s2, "cat(readLines('small.txt'), y)").console, "small 2");
    // The object goes missing from the store: the session comes back
    // without the file, and says which.
    s2.release(Duration::from_secs(120)).unwrap();
    sup2.shutdown();
    let object = objects.iter().find(|p| !p.ends_with("files.json")).unwrap();
    std::fs::remove_file(object).unwrap();
    let sup3 = make();
    let s3 = sup3.resume_session(&id, manual(), "restart").unwrap();
    let r = ok(&s3, "cat(file.exists('big.bin'), y)");
    assert!(r.console.ends_with("\nFALSE 2"), "{}", r.console);
    let w = r.warnings.join("\n");
    assert!(
        w.contains("\"big.bin\"") && w.contains("missing") && w.contains("without it"),
        "{w}"
    );
    // Closing deletes what is kept beside the checkpoint (the session's
    // runner does, once it has ended).
    s3.close();
    rvisor_ffi_tests::wait_for(
        "the closed session's objects to go",
        Duration::from_secs(60),
        || objects_in(dir.path()).is_empty().then_some(()),
    );
    sup3.shutdown();
}

#[test]
fn confined_big_files_are_kept_beside_the_checkpoint() {
    big_files_beside_the_checkpoint(true);
}

#[test]
fn unconfined_big_files_are_kept_beside_the_checkpoint() {
    big_files_beside_the_checkpoint(false);
}

/// Every file below `dir` whose path has an `objects` part.
fn stored_objects(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    files_below(dir)
        .into_iter()
        .filter(|p| p.components().any(|c| c.as_os_str() == "objects"))
        .collect()
}

/// Through `rvisor serve` over a shared store: a 70 MB file R wrote is
/// kept beside the session's checkpoint in the store, comes back after a
/// hibernation and after a restart of the node (same size, same md5), and
/// closing the session deletes its objects from the store.
#[test]
fn a_node_keeps_big_files_beside_checkpoints_in_the_store() {
    use rvisor_ffi_tests::cluster::{call, post_json, Node, NodeOptions, Store};
    let store = rvisor_ffi_tests::TestDir::new("files-beside-store");
    let opts = NodeOptions {
        store: Store::Dir(store.path()),
        ..NodeOptions::default()
    };
    let run = |n: &Node, id: &str, code: &str| {
        let r = post_json(
            &n.url(&format!("/v1/sessions/{id}/run")),
            "t",
            json!({ "code": code }),
        );
        assert_eq!(r.body["outcome"], "complete", "{code}: {r:?}");
        r.body
    };
    let check = "cat(format(file.size('big.bin'), scientific = FALSE), tools::md5sum('big.bin'))";
    let one = Node::start("n1", &opts);
    let a = post_json(&one.url("/v1/sessions"), "t", json!({}));
    assert_eq!(a.status, 201, "{a:?}");
    let id = a.body["id"].as_str().unwrap().to_string();
    run(
        &one,
        &id,
        "writeBin(as.raw(rep(1:255, length.out = 70e6)), 'big.bin')",
    );
    let want = run(&one, &id, check)["console"]
        .as_str()
        .unwrap()
        .to_string();
    assert!(want.starts_with("70000000 "), "{want}");
    let h = post_json(
        &one.url(&format!("/v1/sessions/{id}/hibernate")),
        "t",
        json!({}),
    );
    assert_eq!(h.status, 200, "{h:?}");
    rvisor_ffi_tests::wait_for("the session to hibernate", Duration::from_secs(120), || {
        let s = call("GET", &one.url(&format!("/v1/sessions/{id}")), "t", None);
        (s.body["state"] == "hibernated").then_some(())
    });
    assert_eq!(
        stored_objects(store.path()).len(),
        2,
        "the file and its list"
    );
    let r = run(&one, &id, check);
    assert!(r["console"].as_str().unwrap().ends_with(&want), "{r}");
    assert_eq!(r["warnings"], json!([]), "{r}");
    // A restart of the node (SIGTERM: the session is released to the store).
    let (port, mut one) = (one.port, one);
    one.signal(libc::SIGTERM);
    rvisor_ffi_tests::wait_for("node n1 to exit", Duration::from_secs(60), || {
        one.serve.child.try_wait().ok().flatten()
    });
    drop(one);
    let one = Node::start_on("n1", port, &opts);
    let r = run(&one, &id, check);
    assert!(r["console"].as_str().unwrap().ends_with(&want), "{r}");
    assert_eq!(r["warnings"], json!([]), "{r}");
    let c = call("DELETE", &one.url(&format!("/v1/sessions/{id}")), "t", None);
    assert_eq!(c.status, 204, "{c:?}");
    rvisor_ffi_tests::wait_for(
        "the session's objects to go",
        Duration::from_secs(60),
        || stored_objects(store.path()).is_empty().then_some(()),
    );
}

/// SHA-256 of `b`, lowercase hex.
fn sha256(b: &[u8]) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(b))
}

/// The artifacts of a session call's result, by name.
fn artifacts_of(v: &Value) -> Vec<(String, Value)> {
    v["artifacts"]
        .as_array()
        .map(|a| {
            a.iter()
                .map(|x| (x["name"].as_str().unwrap_or("").to_string(), x.clone()))
                .collect()
        })
        .unwrap_or_default()
}

/// A session call over HTTP reports the files it changed as artifacts
/// (docs/files.md): a file written comes back with its size, media type,
/// sha256 of the bytes the download gives and the download's path; a call
/// that writes nothing reports nothing; a rewrite reports the file again;
/// a streamed call and a failed one report theirs too.
fn session_call_artifacts(confined: bool) {
    let srv = Server::start(confined, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    let run = |code: &str| -> Value {
        c.post(&format!("/v1/sessions/{id}/run"), json!({ "code": code }))
            .json()
    };
    let r = run("write.csv(mtcars, 'out.csv')");
    assert_eq!(r["outcome"], "complete", "{r}");
    let arts = artifacts_of(&r);
    assert_eq!(arts.len(), 1, "{r}");
    let (name, a) = &arts[0];
    assert_eq!(name, "out.csv");
    assert_eq!(a["media_type"], "text/csv");
    assert_eq!(a["uri"], format!("/v1/sessions/{id}/files/out.csv"));
    let got = c.get(a["uri"].as_str().unwrap());
    assert_eq!(got.status, 200);
    assert_eq!(a["size"], got.bytes.len(), "{r}");
    assert_eq!(a["sha256"], sha256(&got.bytes), "{r}");
    let r_size = c.run(&id, "cat(file.size('out.csv'))");
    assert_eq!(r_size, got.bytes.len().to_string());
    // Nothing written: no artifacts (the field is absent).
    let r = run("x <- 1 + 1");
    assert_eq!(r["outcome"], "complete", "{r}");
    assert!(r.get("artifacts").is_none(), "{r}");
    // Rewritten (other content): reported again, with the new bytes' hash.
    let r = run("write.csv(head(mtcars), 'out.csv')");
    let arts = artifacts_of(&r);
    assert_eq!(arts.len(), 1, "{r}");
    let got = c.get(&format!("/v1/sessions/{id}/files/out.csv"));
    assert_eq!(arts[0].1["sha256"], sha256(&got.bytes), "{r}");
    assert_eq!(arts[0].1["size"], got.bytes.len(), "{r}");
    // Streamed (NDJSON): the result event carries them too.
    let agent = ureq::AgentBuilder::new()
        .max_idle_connections(0)
        .timeout(Duration::from_secs(180))
        .build();
    let res = agent
        .post(&format!("{}/v1/sessions/{id}/run", srv.base))
        .set("Authorization", &format!("Bearer {TOK_A}"))
        .set("Accept", "application/x-ndjson")
        .send_json(json!({"code": "dir.create('d'); saveRDS(1:3, 'd/x.rds')"}))
        .expect("a streamed call");
    let body = res.into_string().unwrap();
    let result = body
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .find(|e| e["kind"] == "result")
        .unwrap_or_else(|| panic!("no result event: {body}"));
    let arts = artifacts_of(&result["result"]);
    assert_eq!(arts.len(), 1, "{result}");
    assert_eq!(arts[0].0, "d/x.rds");
    let got = c.get(&format!("/v1/sessions/{id}/files/d/x.rds"));
    assert_eq!(arts[0].1["sha256"], sha256(&got.bytes), "{result}");
    // A call that fails after writing still reports what it wrote.
    let r = run("writeLines('partial', 'p.txt'); stop('boom')");
    assert_eq!(r["outcome"], "error", "{r}");
    let arts = artifacts_of(&r);
    assert_eq!(arts.len(), 1, "{r}");
    assert_eq!(arts[0].0, "p.txt");
    assert_eq!(arts[0].1["sha256"], sha256(b"partial\n"), "{r}");
    // The history (newest first) lists the call's files as before.
    let h = c.get(&format!("/v1/sessions/{id}/history")).json();
    let last_call = h["entries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "call")
        .cloned()
        .unwrap();
    assert_eq!(last_call["files"][0]["name"], "p.txt", "{last_call}");
}

#[test]
fn confined_session_calls_report_the_files_they_changed() {
    session_call_artifacts(true);
}

#[test]
fn unconfined_session_calls_report_the_files_they_changed() {
    session_call_artifacts(false);
}

/// A call that times out after writing a file still reports it: an
/// unconfined session's directory outlives the worker the timeout killed.
#[test]
fn a_timed_out_session_call_reports_what_it_wrote() {
    let srv = Server::start(false, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    let r = c
        .post(
            &format!("/v1/sessions/{id}/run"),
            json!({"code": "writeLines('before the timeout', 'late.txt'); Sys.sleep(60)", "timeout_seconds": 1}),
        )
        .json();
    assert_eq!(r["outcome"], "timed_out", "{r}");
    let arts = artifacts_of(&r);
    assert_eq!(arts.len(), 1, "{r}");
    assert_eq!(arts[0].0, "late.txt");
    assert_eq!(arts[0].1["sha256"], sha256(b"before the timeout\n"), "{r}");
}

/// A confined session's files live in its worker's tmpfs. A call that
/// times out is interrupted, its worker kept: it reports what it wrote. A
/// call whose worker ends (`quit()` here) reports nothing, and indeed its
/// file is gone with the worker. The first call on the new worker is
/// queued while no worker lives, so it has no listing to compare with
/// (docs/files.md, Not yet); the one after reports what it wrote.
#[test]
fn a_confined_call_reports_its_files_while_its_worker_lives() {
    let srv = Server::start(true, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    let run = |code: &str, timeout: Option<u64>| -> Value {
        let mut body = json!({ "code": code });
        if let Some(t) = timeout {
            body["timeout_seconds"] = t.into();
        }
        c.post(&format!("/v1/sessions/{id}/run"), body).json()
    };
    let r = run("writeLines('x', 'late.txt'); Sys.sleep(60)", Some(1));
    assert_eq!(r["outcome"], "timed_out", "{r}");
    let names: Vec<String> = artifacts_of(&r).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["late.txt"], "{r}");
    let r = run("writeLines('z', 'lost.txt'); quit()", None);
    assert_eq!(r["outcome"], "worker_exited", "{r}");
    assert!(r.get("artifacts").is_none(), "{r}");
    let r = run("cat(file.exists('lost.txt'))", None);
    assert!(r["console"].as_str().unwrap().ends_with("FALSE"), "{r}");
    let r = run("writeLines('y', 'next.txt')", None);
    let names: Vec<String> = artifacts_of(&r).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, ["next.txt"], "{r}");
}

/// `session --jsonl`: a call's result lists the files it changed, with a
/// sha256 of the bytes `get_file` gives; a call writing nothing lists none;
/// a rewrite lists the file again.
#[test]
fn jsonl_session_calls_report_the_files_they_changed() {
    use base64::Engine as _;
    use std::io::{BufRead, BufReader, Write};
    use std::os::unix::net::UnixStream;
    let sup = sup(true);
    let (mut to_server, server_in) = UnixStream::pair().unwrap();
    let (server_out, from_server) = UnixStream::pair().unwrap();
    let s2 = sup.clone();
    let t = std::thread::spawn(move || {
        rvisor_server::jsonl::serve(&s2, BufReader::new(server_in), server_out).unwrap()
    });
    let mut lines = BufReader::new(from_server).lines();
    let mut ask = |v: Value| -> Value {
        writeln!(to_server, "{v}").unwrap();
        let line = lines.next().expect("an answer").unwrap();
        serde_json::from_str(&line).unwrap()
    };
    let download = |ask: &mut dyn FnMut(Value) -> Value| -> Vec<u8> {
        let f = ask(json!({"id": 9, "op": "get_file", "path": "out.csv"}));
        base64::engine::general_purpose::STANDARD
            .decode(f["file"]["content_base64"].as_str().unwrap())
            .unwrap()
    };
    let a = ask(json!({"id": 1, "op": "run", "code": "write.csv(mtcars, 'out.csv')"}));
    let arts = artifacts_of(&a["result"]);
    assert_eq!(arts.len(), 1, "{a}");
    assert_eq!(arts[0].0, "out.csv");
    let bytes = download(&mut ask);
    assert_eq!(arts[0].1["size"], bytes.len(), "{a}");
    assert_eq!(arts[0].1["sha256"], sha256(&bytes), "{a}");
    assert!(arts[0].1["uri"]
        .as_str()
        .unwrap()
        .ends_with("/files/out.csv"));
    let a = ask(json!({"id": 2, "op": "run", "code": "1 + 1"}));
    assert_eq!(a["result"]["console"], "[1] 2\n", "{a}");
    assert!(a["result"].get("artifacts").is_none(), "{a}");
    let a = ask(json!({"id": 3, "op": "run", "code": "write.csv(cars, 'out.csv')"}));
    let arts = artifacts_of(&a["result"]);
    assert_eq!(arts.len(), 1, "{a}");
    let bytes = download(&mut ask);
    assert_eq!(arts[0].1["sha256"], sha256(&bytes), "{a}");
    drop(to_server);
    t.join().unwrap();
    sup.shutdown();
}

/// GET with `headers`: status, the headers named in `want`, the body.
fn get_with(
    base: &str,
    path: &str,
    headers: &[(&str, &str)],
    want: &[&str],
) -> (u16, Vec<Option<String>>, Vec<u8>) {
    let agent = ureq::AgentBuilder::new()
        .max_idle_connections(0)
        .timeout(Duration::from_secs(60))
        .build();
    let mut req = agent
        .get(&format!("{base}{path}"))
        .set("Authorization", &format!("Bearer {TOK_A}"));
    for (k, v) in headers {
        req = req.set(k, v);
    }
    let res = match req.call() {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("GET {path}: {e}"),
    };
    let status = res.status();
    let got = want
        .iter()
        .map(|h| res.header(h).map(String::from))
        .collect();
    let mut bytes = Vec::new();
    res.into_reader().read_to_end(&mut bytes).unwrap();
    (status, got, bytes)
}

/// HTTP ranges on a session file R wrote and on a one-shot run's artifact:
/// one range gives exactly its bytes (206, `Content-Range`), an open and a
/// suffix range too, one past the end 416 with `bytes */size`, several
/// ranges the whole file (200), and every answer says `Accept-Ranges`.
#[test]
fn downloads_serve_one_byte_range() {
    let srv = Server::start(false, FileLimits::default());
    let c = Client {
        base: &srv.base,
        token: TOK_A,
    };
    let id = c.session();
    // 300,000 bytes that differ at every offset of a small range.
    c.run(&id, "writeBin(as.raw(rep_len(0:250, 300000)), 'blob.bin')");
    let path = format!("/v1/sessions/{id}/files/blob.bin");
    let whole = c.get(&path).bytes;
    assert_eq!(whole.len(), 300_000);
    let expected: Vec<u8> = (0..300_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(whole, expected, "the file as R wrote it");
    let heads = ["content-range", "accept-ranges", "content-length"];
    let size = whole.len();
    let check = |path: &str, whole: &[u8]| {
        let size = whole.len();
        for (range, start, end) in [
            ("bytes=0-0", 0, 0),
            ("bytes=1000-266143", 1000, 266_143),
            ("bytes=299990-", 299_990, size - 1),
            ("bytes=-7", size - 7, size - 1),
            ("bytes=299999-5000000", 299_999, size - 1),
        ] {
            let (status, h, body) = get_with(&srv.base, path, &[("Range", range)], &heads);
            assert_eq!(status, 206, "{range}");
            assert_eq!(
                h[0].as_deref(),
                Some(format!("bytes {start}-{end}/{size}").as_str()),
                "{range}"
            );
            assert_eq!(h[1].as_deref(), Some("bytes"), "{range}");
            assert_eq!(
                h[2].as_deref(),
                Some((end - start + 1).to_string().as_str())
            );
            assert_eq!(body, &whole[start..=end], "{range}: the bytes");
        }
        let (status, h, body) = get_with(&srv.base, path, &[("Range", "bytes=300000-")], &heads);
        assert_eq!(status, 416, "{}", String::from_utf8_lossy(&body));
        assert_eq!(h[0].as_deref(), Some(format!("bytes */{size}").as_str()));
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "range_not_satisfiable", "{v}");
        let (status, h, body) = get_with(&srv.base, path, &[("Range", "bytes=0-1,5-9")], &heads);
        assert_eq!(status, 200, "several ranges: the whole file");
        assert_eq!(h[0], None);
        assert_eq!(h[1].as_deref(), Some("bytes"));
        assert_eq!(body, whole);
    };
    check(&path, &whole);
    // A one-shot run's stored artifact: the same, and If-Range with its
    // ETag keeps the range while another ETag gives the whole.
    let r = c
        .post(
            "/v1/run",
            json!({"script": "writeBin(as.raw(rep_len(0:250, 300000)), 'out.bin')"}),
        )
        .json();
    let uri = r["artifacts"][0]["uri"]
        .as_str()
        .expect("an artifact")
        .to_string();
    let art = c.get(&uri).bytes;
    assert_eq!(art, expected);
    check(&uri, &art);
    let etag = format!("\"{}\"", r["artifacts"][0]["sha256"].as_str().unwrap());
    let (status, _, body) = get_with(
        &srv.base,
        &uri,
        &[("Range", "bytes=10-19"), ("If-Range", &etag)],
        &heads,
    );
    assert_eq!((status, body.as_slice()), (206, &art[10..20]));
    let (status, _, body) = get_with(
        &srv.base,
        &uri,
        &[("Range", "bytes=10-19"), ("If-Range", "\"another\"")],
        &heads,
    );
    assert_eq!((status, body.len()), (200, size));
}
