//! A cluster on one machine for the multi-node and chaos tests
//! (docs/scale-out.md): real `rvisor serve --node-id nK` processes on
//! loopback ports sharing a store (a directory, or a bucket of a local S3
//! server, moto), and real nginx running deploy/nginx/rvisor.conf as
//! shipped (addresses substituted). nginx and moto are installed by
//! scripts/setup.sh; without them these tests fail and say so.

use crate::{wait_for, ServeBin, ServeOptions, TestDir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// The bucket the S3 store uses.
pub const BUCKET: &str = "rvisor-multinode";
/// How long a node, nginx or moto may take to start.
pub const START: Duration = Duration::from_secs(90);

/// `name` on PATH (or in /usr/sbin, where Debian puts nginx), or a failure
/// that says how to install it.
pub fn tool(name: &str, package: &str) -> PathBuf {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/usr/local/sbin"])
        .map(|d| Path::new(d).join(name))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| {
        panic!(
            "{name} is missing: the multi-node test needs it (run scripts/setup.sh, which \
                 installs {package})"
        )
    })
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free loopback port")
}

/// A child process killed (and reaped) when dropped.
#[derive(Debug)]
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// An answer: status, the node nginx sent it to, the body as JSON.
#[derive(Debug)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// `X-Rvisor-Upstream`: the nodes nginx tried.
    pub upstream: String,
    /// `Retry-After`.
    pub retry_after: Option<String>,
    /// The body, as JSON if it is.
    pub body: Value,
}

pub fn call(method: &str, url: &str, token: &str, body: Option<(&str, Vec<u8>)>) -> Answer {
    let agent = ureq::AgentBuilder::new()
        .timeout(Duration::from_secs(120))
        .build();
    let req = agent
        .request(method, url)
        .set("Authorization", &format!("Bearer {token}"));
    let r = match body {
        Some((ct, bytes)) => req.set("Content-Type", ct).send_bytes(&bytes),
        None => req.call(),
    };
    let res = match r {
        Ok(r) | Err(ureq::Error::Status(_, r)) => r,
        Err(e) => panic!("{method} {url}: {e}"),
    };
    let status = res.status();
    let upstream = res.header("X-Rvisor-Upstream").unwrap_or("").to_string();
    let retry_after = res.header("Retry-After").map(str::to_string);
    let text = res.into_string().unwrap_or_default();
    Answer {
        status,
        upstream,
        retry_after,
        body: serde_json::from_str(&text).unwrap_or(Value::String(text)),
    }
}

pub fn post_json(url: &str, token: &str, v: Value) -> Answer {
    call(
        "POST",
        url,
        token,
        Some(("application/json", v.to_string().into_bytes())),
    )
}

/// moto's S3 server on a free loopback port, with our bucket.
#[derive(Debug)]
pub struct Moto {
    _p: Proc,
    /// `http://127.0.0.1:PORT`.
    pub endpoint: String,
}

impl Moto {
    /// Starts moto and makes the bucket.
    pub fn start() -> Self {
        // pip may put the command outside PATH: the module runs the same.
        let as_module = Command::new("python3")
            .args(["-c", "import moto.server"])
            .output()
            .is_ok_and(|o| o.status.success());
        let mut cmd = if as_module {
            let mut c = Command::new("python3");
            c.args(["-m", "moto.server"]);
            c
        } else {
            Command::new(tool("moto_server", "moto[server] from PyPI"))
        };
        let port = free_port();
        let p = Proc(
            cmd.args(["-H", "127.0.0.1", "-p", &port.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("moto_server starts"),
        );
        let endpoint = format!("http://127.0.0.1:{port}");
        // Answers once it listens: then make the bucket.
        wait_for("moto to listen", START, || {
            ureq::put(&format!("{endpoint}/{BUCKET}"))
                .call()
                .ok()
                .map(|_| ())
        });
        Moto { _p: p, endpoint }
    }

    /// The environment that points a node at it.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT", self.endpoint.clone()),
            ("AWS_ALLOW_HTTP", "true".into()),
            ("AWS_REGION", "us-east-1".into()),
            ("AWS_ACCESS_KEY_ID", "multinode".into()),
            ("AWS_SECRET_ACCESS_KEY", "multinode".into()),
        ]
    }
}

/// Where the nodes keep sessions and tables.
#[derive(Debug, Clone, Copy)]
pub enum Store<'a> {
    /// A bucket of this moto server (`--store s3://...`).
    S3(&'a Moto),
    /// A directory shared by the nodes of this host (`--store DIR`).
    Dir(&'a Path),
}

/// How [`Node::start`] starts a node.
#[derive(Debug, Clone, Copy)]
pub struct NodeOptions<'a> {
    /// The shared store.
    pub store: Store<'a>,
    /// `--tokens FILE` (with an `ops` operator tenant); `None`: no auth.
    pub tokens: Option<&'a Path>,
    /// `--lease-secs`: short, so that a lost node's sessions are taken
    /// over within seconds (the default is 10 s).
    pub lease_secs: u32,
    /// More flags.
    pub extra: &'a [&'a str],
    /// Append each node's log to `DIR/ID.log`.
    pub logs: Option<&'a Path>,
}

impl Default for NodeOptions<'_> {
    fn default() -> Self {
        Self {
            store: Store::Dir(Path::new("/nonexistent")),
            tokens: None,
            lease_secs: 3,
            extra: &[],
            logs: None,
        }
    }
}

/// One `rvisor serve --node-id ID` on a loopback port.
#[derive(Debug)]
pub struct Node {
    /// Its node id.
    pub id: String,
    /// The server process.
    pub serve: ServeBin,
    /// The port it listens on (a restart takes the same one).
    pub port: u16,
}

impl Node {
    /// Starts node `id` on a free port and waits until it is ready.
    pub fn start(id: &str, opts: &NodeOptions<'_>) -> Self {
        Self::start_on(id, free_port(), opts)
    }

    /// Starts node `id` on `port` (again, after it was stopped) and waits
    /// until it is ready.
    pub fn start_on(id: &str, port: u16, opts: &NodeOptions<'_>) -> Self {
        let store = match opts.store {
            Store::S3(_) => format!("s3://{BUCKET}/cluster"),
            Store::Dir(d) => d.display().to_string(),
        };
        let lease = opts.lease_secs.to_string();
        let listen = format!("127.0.0.1:{port}");
        let mut args = vec![
            "--node-id",
            id,
            "--store",
            &store,
            "--drain-grace-secs",
            "60",
            "--style",
            "builtin",
            "--lease-secs",
            &lease,
        ];
        if opts.tokens.is_some() {
            args.extend(["--operator", "ops"]);
        }
        args.extend(opts.extra);
        let serve = ServeBin::start_with(ServeOptions {
            tokens: opts.tokens,
            listen: Some(&listen),
            args: &args,
            env: match opts.store {
                Store::S3(m) => m.env(),
                Store::Dir(_) => Vec::new(),
            },
            log: opts.logs.map(|d| d.join(format!("{id}.log"))),
            confined: false,
        });
        let node = Node {
            id: id.to_string(),
            serve,
            port,
        };
        node.wait_ready();
        node
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.serve.addr)
    }

    /// Waits until `/readyz` answers 200.
    pub fn wait_ready(&self) {
        wait_for(&format!("node {} to be ready", self.id), START, || {
            let r = ureq::get(&self.url("/readyz")).call().ok()?;
            (r.status() == 200).then_some(())
        });
    }

    /// The server's pid.
    pub fn pid(&self) -> u32 {
        self.serve.child.id()
    }

    /// Sends `sig` to the server process (not its workers): SIGSTOP is a
    /// pause (a long GC, a partition from everything), SIGCONT its end.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill only sends a signal to the node, our child, which
        // is not reaped before the Node is dropped (so the pid is its own).
        let r = unsafe { libc::kill(self.pid() as i32, sig) };
        assert_eq!(r, 0, "signal {sig} to node {}", self.id);
    }
}

/// nginx with the shipped config, the nodes' addresses put in. Stopped
/// with SIGTERM (the master takes its workers down; a SIGKILL would leave
/// them running with the port), SIGKILL only if it does not end.
#[derive(Debug)]
pub struct Nginx {
    bin: PathBuf,
    proc: Proc,
    prefix: TestDir,
    /// `IP:PORT` it listens on.
    pub addr: String,
}

const SHIPPED: &str = include_str!("../../deploy/nginx/rvisor.conf");

impl Nginx {
    /// The shipped config with `nodes` (n1, n2, n3 and any more, each as
    /// the comments of the file say to add one) at their addresses.
    pub fn config(nodes: &[&Node], listen: &str) -> String {
        let mut conf = SHIPPED.replace("127.0.0.1:8780", listen);
        for (i, n) in nodes.iter().enumerate().take(3) {
            assert_eq!(n.id, format!("n{}", i + 1));
            conf = conf.replace(&format!("127.0.0.1:878{}", i + 1), &n.serve.addr);
        }
        for n in nodes.iter().skip(3) {
            let id = &n.id;
            let a = &n.serve.addr;
            let last = &nodes[2].serve.addr;
            conf = conf
                .replace(
                    &format!("    server {last} max_fails=1 fail_timeout=10s;\n"),
                    &format!(
                        "    server {last} max_fails=1 fail_timeout=10s;\n    server {a} max_fails=1 fail_timeout=10s;\n"
                    ),
                )
                .replacen(
                    "upstream rvisor_n3 {",
                    &format!("upstream rvisor_{id} {{ server {a}; keepalive 8; }}\nupstream rvisor_n3 {{"),
                    1,
                )
                .replacen("    n3 rvisor_n3;\n", &format!("    n3 rvisor_n3;\n    {id} rvisor_{id};\n"), 1);
        }
        conf
    }

    fn write(prefix: &Path, nodes: &[&Node], listen: &str) {
        let p = prefix.display();
        std::fs::write(prefix.join("rvisor.conf"), Self::config(nodes, listen)).unwrap();
        std::fs::write(
            prefix.join("nginx.conf"),
            format!(
                "daemon off;\nworker_processes 1;\npid {p}/nginx.pid;\nerror_log {p}/error.log info;\n\
                 events {{ worker_connections 512; }}\n\
                 http {{\n  access_log {p}/access.log;\n  client_body_temp_path {p}/body;\n  \
                 proxy_temp_path {p}/proxy;\n  fastcgi_temp_path {p}/fastcgi;\n  uwsgi_temp_path {p}/uwsgi;\n  \
                 scgi_temp_path {p}/scgi;\n  include {p}/rvisor.conf;\n}}\n"
            ),
        )
        .unwrap();
    }

    /// Starts nginx in front of `nodes` and waits until it answers.
    pub fn start(nodes: &[&Node]) -> Self {
        let bin = tool("nginx", "the Debian package nginx");
        let prefix = TestDir::new("rvisor-multinode-nginx");
        let addr = format!("127.0.0.1:{}", free_port());
        Self::write(prefix.path(), nodes, &addr);
        let check = Command::new(&bin)
            .arg("-t")
            .arg("-p")
            .arg(prefix.path())
            .arg("-c")
            .arg(prefix.path().join("nginx.conf"))
            .arg("-e")
            .arg(prefix.path().join("error.log"))
            .output()
            .expect("nginx -t runs");
        assert!(
            check.status.success(),
            "nginx refuses the shipped config: {}",
            String::from_utf8_lossy(&check.stderr)
        );
        let proc = Proc(
            Command::new(&bin)
                .arg("-p")
                .arg(prefix.path())
                .arg("-c")
                .arg(prefix.path().join("nginx.conf"))
                .arg("-e")
                .arg(prefix.path().join("error.log"))
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("nginx starts"),
        );
        let n = Nginx {
            bin,
            proc,
            prefix,
            addr,
        };
        wait_for("nginx to answer", START, || {
            ureq::get(&n.url("/livez")).call().ok().map(|_| ())
        });
        n
    }

    /// `http://ADDR{path}`.
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    /// Rewrites the config for `nodes` and reloads (SIGHUP): new workers
    /// take the new routes, connections in flight finish on the old ones.
    pub fn reload(&self, nodes: &[&Node]) {
        Self::write(self.prefix.path(), nodes, &self.addr);
        let _ = &self.bin;
        // SAFETY: kill only sends a signal to the nginx master, our child.
        let r = unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGHUP) };
        assert_eq!(r, 0, "SIGHUP to nginx");
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SAFETY: kill only sends a signal to the nginx master, our child,
        // not reaped yet (so its pid is still its own).
        unsafe { libc::kill(self.proc.0.id() as i32, libc::SIGTERM) };
        let end = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < end {
            if self.proc.0.try_wait().ok().flatten().is_some() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        // `Proc` then kills the master if it is still there.
    }
}
